"""Prefill and decode pools with different tensor parallelism, end to end.

Two of the cases run an 8-bit KV cache (`--kv-cache-dtype int8`, `fp8`) in both pools:
their tokens must equal `transformers`' with K and V rounded the same way, and the
handoff ships the 8-bit rows with their scales, rank to rank.

`pdserve up --prefill-tp N --decode-tp M` on a tiny float32 checkpoint with 2 KV heads,
both transports, through the official client: every answer equals `transformers`'
greedy tokens; the KV crossed rank to rank exactly once (bytes counted = blocks sent x
one whole block of every head: each head's slice went once, from the rank that owns it,
to the rank that owns it); no decode worker prefilled; `/workers` shows each rank of the
tensor-parallel replicas with its own half of the sharded weights and of the KV heads.

The gRPC 1 -> 2 cluster has two decode replicas and goes on (one cluster start less in
CI) to lose a non-driver rank mid-stream: the replica's next collective fails at once
(the peer's socket closed; a stalled rank would fail it within distributed_timeout_s),
its engine stops and fails its streams, the replica leaves the index, and the router
resumes the stream on the other replica. The client must receive exactly
`transformers`' tokens, and afterwards no surviving worker holds a KV block or a
pending transfer.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import openai
import pytest

BLOCK = 8
MAX_TOKENS = 6
STREAM_TOKENS = 300
CASES = {  # transport, prefill TP, decode TP, decode replicas, KV cache dtype
    "grpc-p2-d1-int8kv": ("grpc", 2, 1, 1, "int8"),
    "ucx-p2-d1": ("ucx", 2, 1, 1, "auto"),
    "ucx-p1-d2-fp8kv": ("ucx", 1, 2, 1, "fp8"),
    "grpc-p1-d2, a rank killed": ("grpc", 1, 2, 2, "auto"),
}
# Bytes of one token of one KV head (head_dim 16): float32 values, or the 8-bit formats'
# 16 codes and a 2-byte scale (engine/modeling/kv_quant.py).
ROW_BYTES = {"auto": 16 * 4, "int8": 16 + 2, "fp8": 16 + 2}


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
    transport, prefill_tp, decode_tp, decode_replicas, kv_dtype = CASES[case]
    model_dir = Path(make_checkpoint(num_heads=4, num_kv_heads=2, max_position_embeddings=512))
    want = hf_greedy(model_dir, prompts(), MAX_TOKENS, kv_cache_dtype=kv_dtype)
    flags = (
        *("--kv-cache-dtype", kv_dtype),
        *("--mode", "disagg", "--transport", transport),
        *("--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp)),
        *("--prefill-replicas", "1", "--decode-replicas", str(decode_replicas)),
        *("--dtype", "float32", "--block-size", str(BLOCK), "--replica-cpus", "0.1"),
        *("--threads", "1", "--heartbeat-s", "0.5", "--worker-lease-s", "3"),
    )
    with pdserve_up(model_dir, *flags) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        got = [api.greedy(client, model, p, MAX_TOKENS) for p in prompts()]
        assert got == want, f"{case}: tokens differ from transformers'"
        assert api.local_prefills(url) == {}, f"{case}: a decode worker prefilled"
        blocks = api.metric(url, "pdserve_kv_transfer_blocks_total")
        sent = api.metric(url, "pdserve_kv_transfer_bytes_total")
        # one block of every layer, K and V, both KV heads: 2 x 2 x 2 x 8 rows (an 8-bit
        # cache ships its codes and scales: 18 bytes a row against float32's 64)
        row = ROW_BYTES[kv_dtype]
        assert blocks > 0 and sent == blocks * 2 * 2 * 2 * BLOCK * row, (blocks, sent)
        workers = api.get_json(f"{url}/workers")["workers"]
        kv_format = f"{'float32' if kv_dtype == 'auto' else kv_dtype}/{BLOCK}"
        assert {w["kv_format"] for w in workers} == {kv_format}, workers
        tp_workers = [w for w in workers if "tensor_parallel" in w]
        tp_role = "prefill" if prefill_tp > 1 else "decode"
        assert [w["role"] for w in tp_workers] == [tp_role] * (
            decode_replicas if tp_role == "decode" else 1
        )
        for worker in tp_workers:
            tp = worker["tensor_parallel"]
            ranks = tp["ranks"]
            assert tp["size"] == 2 and [r["rank"] for r in ranks] == [0, 1]
            assert len({r["pid"] for r in ranks}) == 2, "each rank is a process of its own"
            assert ranks[0]["sharded_weight_bytes"] == ranks[1]["sharded_weight_bytes"] > 0
            assert ranks[0]["kv_cache_bytes"] == ranks[1]["kv_cache_bytes"] > 0
        busy = [w["tensor_parallel"] for w in tp_workers if w["tensor_parallel"]["steps"]]
        assert busy and all(tp["all_reduce_ms_per_step"] > 0 for tp in busy)
        if decode_replicas > 1:
            kill_a_rank_mid_stream(url, client, model, api, hf_greedy, model_dir)


def kill_a_rank_mid_stream(
    url: str, client: Any, model: str, api: Any, hf_greedy: Any, model_dir: Path
) -> None:
    rng = random.Random(12)
    prompt = [rng.randrange(5, 512) for _ in range(40)]
    (want,) = hf_greedy(model_dir, [prompt], STREAM_TOKENS)
    local_before = api.local_prefills(url)
    got: list[int] = []
    killed = None
    for chunk in api.greedy_stream(client, model, prompt, STREAM_TOKENS):
        got += chunk.choices[0].model_extra["token_ids"]
        if killed is None and len(got) >= 8:
            busy = [w for w in api.get_json(f"{url}/workers")["workers"] if w["running"]]
            assert len(busy) == 1 and busy[0]["role"] == "decode", busy
            killed = busy[0]
            ranks = killed["tensor_parallel"]["ranks"]
            assert ranks[1]["pid"] != killed["pid"], "rank 1 is a process of its own"
            os.kill(ranks[1]["pid"], signal.SIGKILL)
    assert killed is not None
    assert got == want, "the resumed stream must continue exactly where it broke"
    assert api.metric(url, "pdserve_decode_resumes_total") == 1.0
    assert api.local_prefills(url) == {**local_before, "resume": 1.0}
    for w in api.get_json(f"{url}/workers")["workers"]:
        if w["worker_id"] != killed["worker_id"] and "error" not in w:
            assert (w["running"], w["kv_blocks_used"]) == (0, 0), w
            assert w.get("pending_transfers", 0) == 0, w
