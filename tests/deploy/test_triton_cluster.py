"""A disaggregated cluster on the Triton path, on CPU under Triton's interpreter.

`pdserve up --attention-backend triton` with 1 prefill and 1 decode worker on a tiny
float32 checkpoint: each worker's engine runs every Triton kernel it has (attention,
cache writes, norm, rotary), and each handoff packs its KV with kv_pack on the prefill
worker and unpacks it with kv_unpack on the decode worker (engine/llm_engine.py,
`triton_off_cuda`). The replicas inherit TRITON_INTERPRET=1 from this process's
environment, through `pdserve up` and Ray. Through the official client the tokens equal
`transformers'`; every prompt crossed (KV blocks sent, no local prefill); `/workers`
shows the kernels packed and unpacked every block that was sent.

Every kernel launch is interpreted: one small cluster, few short prompts and tokens.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import openai
import pytest

BLOCK = 8
MAX_TOKENS = 4


def prompts() -> list[list[int]]:
    """Two sharing their first two blocks, and one of its own."""
    rng = random.Random(7)
    shared = [rng.randrange(5, 512) for _ in range(2 * BLOCK)]
    return [
        [*shared, *(rng.randrange(5, 512) for _ in range(5))],
        [*shared, *(rng.randrange(5, 512) for _ in range(11))],
        [rng.randrange(5, 512) for _ in range(13)],
    ]


def test_disaggregated_cluster_on_the_triton_kernels(
    make_checkpoint: Any,
    pdserve_up: Any,
    hf_greedy: Any,
    api: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # also on a machine with a GPU: the replicas run on CPU, so interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model_dir = Path(make_checkpoint(num_heads=4, num_kv_heads=2))
    want = hf_greedy(model_dir, prompts(), MAX_TOKENS)
    flags = (
        *("--mode", "disagg", "--attention-backend", "triton"),
        *("--prefill-replicas", "1", "--decode-replicas", "1"),
        *("--dtype", "float32", "--block-size", str(BLOCK), "--replica-cpus", "0"),
        *("--threads", "1", "--heartbeat-s", "0.5"),
        # a step of 32 tokens at most: the prefill worker's start-up warm-up is two
        # prompts of the step budget (512 tokens at most), through every interpreted
        # kernel: 90 s of this test's 128 with the default budget (2026-12-07)
        *("--max-num-batched-tokens", "32"),
    )
    with pdserve_up(model_dir, *flags) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        got = [api.greedy(client, model, p, MAX_TOKENS) for p in prompts()]
        assert got == want, "tokens differ from transformers'"
        assert api.local_prefills(url) == {}, "a decode worker prefilled"
        sent = api.metric(url, "pdserve_kv_transfer_blocks_total")
        workers = {w["role"]: w for w in api.get_json(f"{url}/workers")["workers"]}
        assert sorted(workers) == ["decode", "prefill"], workers
        packed = workers["prefill"]["kv_kernel_blocks_packed"]
        unpacked = workers["decode"]["kv_kernel_blocks_unpacked"]
        # every block sent went through kv_pack there and kv_unpack here, none through torch
        assert sent > 0 and packed == unpacked == sent, (sent, packed, unpacked)
