"""Faults only several hosts can have: a decode node cut off mid-stream, then back.

Four namespace hosts (head: Ray head, Redis, router; one prefill node; two decode nodes),
started as an operator starts them (`pdserve.benchmarks.netns`). The decode node serving
a long greedy stream loses its link while its processes keep running. The client must
still get exactly `transformers`' tokens (the router resumes the stream on the other
decode node); the partitioned worker must leave placement within its lease + 1 s (it can
no longer renew its lease in Redis); and when the link comes back, the cut node's old
state must not serve (Ray has declared the node dead, so its raylet and replicas exit)
while the cluster goes on serving reference tokens, with no block held and no transfer
pending on the workers that remain.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pdserve.benchmarks.bench_report import sample, scrape_metrics
from pdserve.benchmarks.netns import start_cluster

MAX_TOKENS = 400
LEASE_S = 3.0
HEARTBEAT_S = 0.5
# Ray's own failure detection, shortened so that the cut node is declared dead in ~2 s
RAY_HEALTH = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "4",
}


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    return Path(make_checkpoint(max_position_embeddings=1024))


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


async def seconds_until_gone(redis_url: str, model: str, worker_id: str, since: float) -> float:
    """Seconds from `since` to the end of the first index read that no longer lists
    `worker_id` as live: an upper bound on when it left placement (polled every 50 ms)."""
    import redis.asyncio as aioredis

    from pdserve.cluster.prefix_index import PrefixIndex

    client = aioredis.Redis.from_url(redis_url)
    try:
        index = PrefixIndex(client, model, LEASE_S)
        deadline = since + LEASE_S + 10.0
        while time.monotonic() < deadline:
            live = {w.worker_id for w in await index.live_workers()}
            now = time.monotonic()
            if worker_id not in live:
                return now - since
            await asyncio.sleep(0.05)  # a poll of the index, bounded by the deadline
        return float("inf")
    finally:
        await client.aclose()


def live_decode_count(url: str) -> int:
    return int(get_json(f"{url}/health")["workers"].get("decode", 0))


def test_a_decode_node_cut_mid_stream(
    make_topology: Any, model_dir: Path, hf_greedy: Any, tmp_path: Path, api: Any
) -> None:
    import openai

    prompt = [5 + (13 * j) % 500 for j in range(40)]
    (want,) = hf_greedy(model_dir, [prompt], MAX_TOKENS)
    with make_topology(4) as topo:
        pools = ["router", "prefill", "decode", "decode"]
        flags = ["--dtype", "float32", "--disagg-policy", "always", "--block-size", "8"]
        flags += ["--heartbeat-s", str(HEARTBEAT_S), "--worker-lease-s", str(LEASE_S)]
        url = start_cluster(topo, model_dir, "grpc", pools, tmp_path, flags, RAY_HEALTH)
        by_address = {n.address: n for n in topo.nodes}
        assert live_decode_count(url) == 2

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        stream = api.greedy_stream(client, model, prompt, MAX_TOKENS)
        got: list[int] = []
        cut_at = None
        cut_worker: dict[str, Any] | None = None
        for chunk in stream:
            got += chunk.choices[0].model_extra["token_ids"]
            if cut_at is None and len(got) >= 8:
                busy = [w for w in get_json(f"{url}/workers")["workers"] if w.get("running")]
                assert len(busy) == 1 and busy[0]["role"] == "decode", busy
                cut_worker = busy[0]
                node = by_address[re.sub(r":\d+$", "", cut_worker["address"])]
                topo.cut(node)
                cut_at = time.monotonic()
                # watch the index from now on, while the stream goes on resuming
                watch = ThreadPoolExecutor(1).submit(
                    asyncio.run,
                    seconds_until_gone(topo.redis_url, model, cut_worker["worker_id"], cut_at),
                )
        assert cut_at is not None and cut_worker is not None
        assert got == want, "the resumed stream must continue exactly where it broke"
        metrics = scrape_metrics(url)
        assert sample(metrics, "pdserve_decode_resumes_total") == 1.0

        # the partitioned worker leaves placement within its lease (+ 1 s): the index
        # placement reads, watched directly from the cut on (the router's HTTP path would
        # add its own latency on a loaded machine)
        left_s = watch.result(timeout=LEASE_S + 15)
        print(f"cut worker left placement {left_s:.2f} s after the cut (lease {LEASE_S} s)")
        assert left_s <= LEASE_S + 1.0, f"left placement after {left_s:.1f} s"
        assert live_decode_count(url) == 1

        # the link comes back: the old node's state must not serve again, the cluster does
        topo.heal(node)
        for _ in range(3):
            out = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=16,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert out.choices[0].model_extra["token_ids"] == want[:16]
        workers = get_json(f"{url}/workers")["workers"]
        assert cut_worker["worker_id"] not in {w["worker_id"] for w in workers}
        for w in workers:
            if "error" not in w:
                assert (w["running"], w["kv_blocks_used"]) == (0, 0), w
                assert w.get("pending_transfers", 0) == 0, w
