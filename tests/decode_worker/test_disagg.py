"""Prefill worker -> decode worker over a KV transport, in one process (no Ray yet).

Each request goes the way the router will send it: the decode worker expects the KV,
the prefill worker prefills and pushes, the decode worker streams. Tokens must equal
the colocated engine's; a prefill that never pushes falls back to local prefill.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.kv_transfer.base import ReceiverConfig
from pdserve.kv_transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from pdserve.kv_transfer.torch_payload import layout_of
from pdserve.prefill_worker.worker import PrefillWorker

TOKEN = "cluster-token"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 512) for _ in range(37)]
    return [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (2, 11, 30)] + [
        [rng.randrange(3, 512) for _ in range(5)]
    ]


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    return Path(make_checkpoint(num_heads=4, num_kv_heads=2))


def new_engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=8, num_kv_blocks=64))


def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)


def colocated_tokens(model_dir: Path, sampled: bool = False) -> list[list[int]]:
    eng = new_engine(model_dir)
    for i, prompt in enumerate(prompts()):
        eng.add_request(f"r{i}", prompt, seeded(i) if sampled else GREEDY)
    done: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for out in eng.step():
            done[out.request_id] = out.token_ids
    return [done[f"r{i}"] for i in range(len(prompts()))]


async def collect(stream: Any) -> list[int]:
    tokens: list[int] = []
    async for out in stream:
        tokens = out.token_ids
    return tokens


async def serve_all(
    model_dir: Path, push: bool, sampled: bool = False
) -> tuple[list[list[int]], int, list[int]]:
    hub = LoopbackHub()
    p_async, d_async = AsyncEngine(new_engine(model_dir)), AsyncEngine(new_engine(model_dir))
    layout = layout_of(d_async.engine.runner.kv_cache)
    decode = DecodeWorker(
        d_async, LoopbackReceiver(hub, ReceiverConfig(TOKEN, layout)), kv_wait_timeout_s=0.5
    )
    prefill = PrefillWorker(p_async, LoopbackSender(hub), TOKEN)
    address = await decode.start()
    results, sent = [], []
    try:
        for i, prompt in enumerate(prompts()):  # dual dispatch, as the router will
            rid, params = f"r{i}", seeded(i) if sampled else GREEDY
            decode.expect_kv(rid)
            stream = collect(decode.generate(rid, prompt, params, kv_expected=True))
            if push:
                pushed = prefill.prefill(rid, prompt, params, address)
                tokens, result = await asyncio.gather(stream, pushed)
                assert tokens[0] == result.first_token
                sent.append(result.num_blocks_sent)
            else:
                tokens = await stream
            results.append(tokens)
        assert decode.receiver.num_pending == 0
        for eng in (p_async.engine, d_async.engine):
            eng.block_pool.check_no_leaks()
        return results, decode.num_local_fallbacks, sent
    finally:
        await decode.close()
        await p_async.close()
        await d_async.close()


def test_disaggregated_serving_matches_colocated(model_dir: Path) -> None:
    results, fallbacks, sent = asyncio.run(asyncio.wait_for(serve_all(model_dir, True), 120))
    assert results == colocated_tokens(model_dir)
    assert fallbacks == 0
    assert sent == [5, 6, 9, 1]  # every prompt block (ceil(len / 8)): no prefix skipping yet


def test_missing_prefill_falls_back_to_local_prefill(model_dir: Path) -> None:
    results, fallbacks, _ = asyncio.run(asyncio.wait_for(serve_all(model_dir, False), 120))
    assert results == colocated_tokens(model_dir)
    assert fallbacks == len(prompts())


def test_seeded_sampling_is_the_same_disaggregated(model_dir: Path) -> None:
    """P samples the first token and D the rest; a seed still fixes every token."""
    run = serve_all(model_dir, True, sampled=True)
    results, fallbacks, _ = asyncio.run(asyncio.wait_for(run, 120))
    assert fallbacks == 0
    assert results == colocated_tokens(model_dir, sampled=True)
    assert results != colocated_tokens(model_dir)  # really sampled, not greedy
