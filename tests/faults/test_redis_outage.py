"""Redis goes away and comes back: serving never stops, the index is rebuilt.

While Redis is down Ray Serve picks the workers, and the split still happens: every
request still gets the reference tokens, the prefill worker pushes every block of each
prompt to the decode worker that took it (`pdserve_kv_transfer_blocks_total` keeps
rising), no decode worker prefills a prompt itself, and `/health` says "degraded". When
Redis returns, the workers register again and republish what they hold, so placement by
cached prefix works again: a request sharing a prefix that the decode worker cached
before the outage ships only the blocks it lacks.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import openai
import pytest

from pdserve.deploy.redis_server import EmbeddedRedis

pytestmark = pytest.mark.redis  # stops and restarts a redis-server of its own

BLOCK_SIZE = 8
MAX_TOKENS = 6
REJOIN_DEADLINE_S = 30.0


def test_serving_survives_a_redis_outage_and_the_index_is_rebuilt(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any, poll: Any
) -> None:
    model_dir = Path(make_checkpoint())
    rng = random.Random(21)
    shared = [rng.randrange(5, 512) for _ in range(10 * BLOCK_SIZE)]
    first = shared + [rng.randrange(5, 512) for _ in range(5)]
    during = [[rng.randrange(5, 512) for _ in range(30 + 7 * i)] for i in range(3)]
    after = shared + [rng.randrange(5, 512) for _ in range(19)]
    want = hf_greedy(model_dir, [first, *during, after], MAX_TOKENS)
    redis = EmbeddedRedis().start()
    flags = (
        *("--prefill-replicas", "1", "--decode-replicas", "1", "--replica-cpus", "0"),
        *("--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--threads", "1"),
        *("--heartbeat-s", "0.5", "--worker-lease-s", "3", "--redis-url", redis.url),
    )
    try:
        with pdserve_up(model_dir, *flags) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            model = client.models.list().data[0].id

            def greedy(prompt: list[int]) -> list[int]:
                return list(api.greedy(client, model, prompt, MAX_TOKENS))

            assert greedy(first) == want[0]
            redis.stop()
            assert api.get_json(f"{url}/health", any_status=True)["status"] == "degraded"
            for prompt, ref in zip(during, want[1:4], strict=True):
                blocks_before = api.metric(url, "pdserve_kv_transfer_blocks_total")
                assert greedy(prompt) == ref, "placement without the index must still serve"
                blocks = api.metric(url, "pdserve_kv_transfer_blocks_total") - blocks_before
                assert blocks == -(-len(prompt) // BLOCK_SIZE), "the prefill pool must push"
            assert api.local_prefills(url) == {}, "no request may bypass the split"

            redis = EmbeddedRedis(port=redis.port).start()  # empty: the index is gone

            def rejoined() -> Any:
                health = api.get_json(f"{url}/health", any_status=True)
                return health if health["status"] == "ok" else None

            health = poll("every worker back in the index", rejoined, REJOIN_DEADLINE_S, 0.2)
            assert health == {
                "status": "ok",
                "mode": "disagg",
                "workers": {"prefill": 1, "decode": 1},
            }

            sent_before = api.metric(url, "pdserve_kv_transfer_bytes_total")
            assert greedy(after) == want[4]
            sent = api.metric(url, "pdserve_kv_transfer_bytes_total") - sent_before
            # float32, 2 layers, K and V, 2 kv heads, head_dim 16
            block_bytes = 2 * 2 * 2 * BLOCK_SIZE * 16 * 4
            missing = -(-len(after) // BLOCK_SIZE) - 10
            assert sent == missing * block_bytes, "the rebuilt index knows D's cached prefix"
            for w in api.get_json(f"{url}/workers")["workers"]:
                assert (w["running"], w["waiting"], w["kv_blocks_used"]) == (0, 0, 0), w
                assert w.get("pending_transfers", 0) == 0, w
            assert api.local_prefills(url) == {}
            # the router's in-memory view (router_index: memory) was rebuilt, not kept
            snapshots = {
                reason: api.metric(url, "pdserve_router_index_snapshots_total", reason=reason)
                for reason in ("start", "restart", "gap")
            }
            assert snapshots["start"] == 1 and snapshots["restart"] + snapshots["gap"] >= 1
            assert api.metric(url, "pdserve_router_index_matches_total", source="memory") > 0
    finally:
        redis.stop()
