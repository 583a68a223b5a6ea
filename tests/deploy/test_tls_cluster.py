"""A disaggregated cluster whose KV pushes go over mutual TLS (`pdserve up --kv-tls-*`).

One small cluster (1 prefill, 1 decode): the certificates come from a CA the test makes
(`trustme`, an IP SAN for 127.0.0.1, the address the receivers announce). Tokens must
equal transformers' greedy ones, and the split must really have happened over the TLS
channel: KV blocks were sent, and decode prefilled nothing itself.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from pdserve.benchmarks.bench_report import scrape_metrics
from pdserve.kv_transfer.base import KVLayout, make_header
from pdserve.kv_transfer.errors import PeerUnavailableError, UnauthorizedError
from pdserve.kv_transfer.grpc_backend import GrpcSender

BLOCK_SIZE = 8
MAX_TOKENS = 6


async def _plaintext_push(address: str) -> None:
    layout = KVLayout(1, 1, 8, BLOCK_SIZE, "float32")
    payload = np.zeros(layout.block_bytes, np.uint8)
    sender = GrpcSender()
    try:
        header = make_header("probe", "m", layout, payload, "not-the-token")
        await sender.send(address, header, payload, timeout_s=10)
    finally:
        await sender.close()


def test_a_cluster_with_mutual_tls_serves_the_reference_tokens(
    api: Any,
    make_checkpoint: Any,
    pdserve_up: Any,
    hf_greedy: Any,
    tmp_path: Path,
    kv_tls_flags: Any,
) -> None:
    model_dir = Path(make_checkpoint())
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 512) for _ in range(n)] for n in (3 * BLOCK_SIZE + 2, 11)]
    want = hf_greedy(model_dir, prompts, MAX_TOKENS)
    flags = (
        *("--prefill-replicas", "1", "--decode-replicas", "1", "--replica-cpus", "0"),
        *("--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--threads", "1"),
        *kv_tls_flags(tmp_path),
        "--kv-tls-mutual",
    )
    with pdserve_up(model_dir, *flags) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        got = [api.greedy(client, model, prompt, MAX_TOKENS) for prompt in prompts]
        assert got == want
        metrics = scrape_metrics(url)
        (decode,) = [w for w in api.get_json(f"{url}/workers")["workers"] if w["role"] == "decode"]
        # The live receiver takes no plaintext push: the connection fails before any
        # header (a plaintext receiver would answer this wrong token with Unauthorized).
        with pytest.raises(PeerUnavailableError) as refused:
            asyncio.run(_plaintext_push(decode["address"]))
        assert not isinstance(refused.value, UnauthorizedError)
    blocks = sum(
        v for (name, _), v in metrics.items() if name == "pdserve_kv_transfer_blocks_total"
    )
    assert blocks >= -(-len(prompts[0]) // BLOCK_SIZE), "no KV crossed the TLS channel"
    local = [v for (name, _), v in metrics.items() if name == "pdserve_decode_local_prefill_total"]
    assert sum(local) == 0, f"decode prefilled locally: {local}"
