"""KV that arrives after the decode worker stopped waiting: local prefill, nothing leaks.

The decode workers here wait only 1 ms for pushed KV, so every push is late: each decode
worker must prefill locally (counted with reason "kv_late", and nothing else) and still
return the reference tokens, the late push must be refused and freed on both sides, and
afterwards no block is referenced and no transfer pending. (Corrupted and truncated
transfers end in the same fallback; the transport's conformance suite, tests/kv_transfer,
shows them refused and freed on both sides.)
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import openai

MAX_TOKENS = 6
NUM_REQUESTS = 6


def test_late_kv_falls_back_to_local_prefill_and_is_freed(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any
) -> None:
    model_dir = Path(make_checkpoint())
    rng = random.Random(51)
    prompts = [[rng.randrange(5, 512) for _ in range(30 + 11 * i)] for i in range(NUM_REQUESTS)]
    want = hf_greedy(model_dir, prompts, MAX_TOKENS)
    flags = (
        *("--prefill-replicas", "1", "--decode-replicas", "1", "--replica-cpus", "0"),
        *("--dtype", "float32", "--block-size", "8", "--threads", "1"),
        *("--kv-wait-timeout-s", "0.001"),
    )
    with pdserve_up(model_dir, *flags) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        before = api.local_prefills(url)  # `pdserve up`'s readiness probe was late too
        assert set(before) <= {"kv_late"}, before
        for prompt, ref in zip(prompts, want, strict=True):
            assert api.greedy(client, model, prompt, MAX_TOKENS) == ref
        local = api.local_prefills(url)
        assert set(local) == {"kv_late"}, local
        late = local["kv_late"] - before.get("kv_late", 0)
        assert late == NUM_REQUESTS, "every decode worker must have prefilled itself"
        assert api.metric(url, "pdserve_kv_transfer_failures_total") >= NUM_REQUESTS
        for w in api.get_json(f"{url}/workers")["workers"]:
            assert (w["running"], w["waiting"], w["kv_blocks_used"]) == (0, 0, 0), w
            assert w.get("pending_transfers", 0) == 0, w
