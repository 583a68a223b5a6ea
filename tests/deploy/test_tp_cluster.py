"""Prefill and decode pools with different tensor parallelism, end to end.

`pdserve up --prefill-tp N --decode-tp M` on a tiny float32 checkpoint with 2 KV heads,
both transports, through the official client: every answer equals `transformers`'
greedy tokens; the KV crossed rank to rank exactly once (bytes counted = blocks sent x
one whole block of every head: each head's slice went once, from the rank that owns it,
to the rank that owns it); no decode worker prefilled; `/workers` shows each rank of the
tensor-parallel replica with its own half of the sharded weights and of the KV heads.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import openai
import pytest

BLOCK = 8
MAX_TOKENS = 6
CASES = {
    "grpc-p2-d1": ("grpc", 2, 1),
    "grpc-p1-d2": ("grpc", 1, 2),
    "ucx-p2-d1": ("ucx", 2, 1),
    "ucx-p1-d2": ("ucx", 1, 2),
}


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(5, 512) for _ in range(4 * BLOCK)]
    return [shared + [rng.randrange(5, 512) for _ in range(n)] for n in (3, 11)] + [
        [rng.randrange(5, 512) for _ in range(n)] for n in (9, 30)
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_pools_of_different_tensor_parallelism(
    case: str, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any, api: Any
) -> None:
    transport, prefill_tp, decode_tp = CASES[case]
    model_dir = Path(make_checkpoint(num_heads=4, num_kv_heads=2, max_position_embeddings=512))
    want = hf_greedy(model_dir, prompts(), MAX_TOKENS)
    flags = (
        *("--mode", "disagg", "--transport", transport),
        *("--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp)),
        *("--prefill-replicas", "1", "--decode-replicas", "1", "--dtype", "float32"),
        *("--block-size", str(BLOCK), "--replica-cpus", "0.1", "--threads", "1"),
    )
    with pdserve_up(model_dir, *flags) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        got = [api.greedy(client, model, p, MAX_TOKENS) for p in prompts()]
        assert got == want, f"{case}: tokens differ from transformers'"
        assert api.local_prefills(url) == {}, f"{case}: a decode worker prefilled"
        blocks = api.metric(url, "pdserve_kv_transfer_blocks_total")
        sent = api.metric(url, "pdserve_kv_transfer_bytes_total")
        # one block of every layer, K and V, both KV heads: 2 x 2 x 2 x 8 x 16 x 4 bytes
        assert blocks > 0 and sent == blocks * 2 * 2 * 2 * BLOCK * 16 * 4, (blocks, sent)
        workers = api.get_json(f"{url}/workers")["workers"]
        tp_workers = [w for w in workers if "tensor_parallel" in w]
        assert [w["role"] for w in tp_workers] == ["prefill" if prefill_tp > 1 else "decode"]
        tp = tp_workers[0]["tensor_parallel"]
        ranks = tp["ranks"]
        assert tp["size"] == 2 and [r["rank"] for r in ranks] == [0, 1]
        assert len({r["pid"] for r in ranks}) == 2, "each rank is a process of its own"
        assert ranks[0]["sharded_weight_bytes"] == ranks[1]["sharded_weight_bytes"] > 0
        assert ranks[0]["kv_cache_bytes"] == ranks[1]["kv_cache_bytes"] > 0
        assert tp["steps"] > 0 and tp["all_reduce_ms_per_step"] > 0
