"""Prefill on one engine, decode on another: the KV handoff the cluster is built on.

Tokens must equal the colocated engine's (itself pinned to `transformers` by
test_correctness.py), whether the decode side gets every prompt block or only those it
lacks; the first token's logprobs travel with the KV; a handoff it cannot use is
refused with nothing held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdserve.common.hashing import hash_block_chain
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.worker.kv_handoff import KVImportError
from pdserve.kv_transfer.base import KVLayout, ReceiverConfig, make_header
from pdserve.kv_transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender

BLOCK = 4
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(3, 512) for _ in range(40)]  # 10 blocks of 4
    tails = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 0)]
    return [shared + tail for tail in tails] + [[rng.randrange(3, 512) for _ in range(17)]]


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    return Path(make_checkpoint(num_heads=4, num_kv_heads=2))


def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=BLOCK, num_kv_blocks=96))


def run_to_end(eng: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for out in eng.step():
            tokens[out.request_id] = out.token_ids
    return tokens


def prefill(p_eng: LLMEngine, rid: str, prompt: list[int]) -> int:
    p_eng.add_request(rid, prompt, PREFILL, hold_kv=True)
    (first,) = run_to_end(p_eng)[rid]
    return first


def cached_blocks(d_eng: LLMEngine, prompt: list[int]) -> int:
    """Leading prompt blocks the decode engine still holds (what the index would say)."""
    hashes = hash_block_chain(prompt, BLOCK, d_eng.hash_namespace)[: (len(prompt) - 1) // BLOCK]
    return len(d_eng.block_pool.get_computed_blocks(hashes))


def test_disaggregated_tokens_equal_colocated(model_dir: Path) -> None:
    colocated = engine(model_dir)
    for i, prompt in enumerate(prompts()):
        colocated.add_request(f"r{i}", prompt, GREEDY)
    expected = run_to_end(colocated)

    p_eng, d_eng = engine(model_dir), engine(model_dir)
    sent_blocks = []
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts()):
        rid = f"r{i}"
        first = prefill(p_eng, rid, prompt)
        skip = cached_blocks(d_eng, prompt)  # 0 for the first, 10 for the prefix sharers
        export = p_eng.export_kv(rid, first_block=skip)
        sent_blocks.append(export.payload.shape[2])
        out = d_eng.add_prefilled_request(
            rid, prompt, export.first_token, GREEDY, export.payload, first_block=skip
        )
        p_eng.release_kv(rid)
        assert out.token_ids == [first] and out.num_cached_tokens == skip * BLOCK
        got.update(run_to_end(d_eng))  # decode each before the next so its blocks are cached
    assert got == expected
    # prompts 1 and 2 share prompt 0's 10 cached blocks: only their own tail crosses
    assert sent_blocks == [11, 3, 1, 5]
    p_eng.block_pool.check_no_leaks()
    d_eng.block_pool.check_no_leaks()


def test_unusable_handoff_is_refused_and_holds_nothing(model_dir: Path) -> None:
    p_eng, d_eng = engine(model_dir), engine(model_dir)
    prompt = prompts()[0]
    first = prefill(p_eng, "r", prompt)
    full = p_eng.export_kv("r", first_block=0)
    partial = p_eng.export_kv("r", first_block=5)
    p_eng.release_kv("r")
    with pytest.raises(KVImportError, match="cached"):  # the decode side lacks blocks 0-4
        d_eng.add_prefilled_request("r", prompt, first, GREEDY, partial.payload, first_block=5)
    with pytest.raises(KVImportError, match="payload holds"):
        d_eng.add_prefilled_request("r", prompt, first, GREEDY, full.payload[:, :, :3])
    assert not d_eng.has_unfinished
    d_eng.block_pool.check_no_leaks()
    p_eng.block_pool.check_no_leaks()


def test_handoff_through_a_kv_transport(model_dir: Path) -> None:
    """The payload crosses the transfer API as bytes and comes back as the same KV."""
    p_eng, d_eng, colocated = engine(model_dir), engine(model_dir), engine(model_dir)
    prompt = prompts()[3]
    colocated.add_request("r", prompt, GREEDY)
    expected = run_to_end(colocated)["r"]
    cfg = p_eng.model_config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, "float32")
    first = prefill(p_eng, "r", prompt)
    export = p_eng.export_kv("r")
    payload = export.payload.view(torch.uint8).numpy().reshape(-1)

    async def ship() -> np.ndarray:
        hub = LoopbackHub()
        receiver = LoopbackReceiver(hub, ReceiverConfig(cluster_token="t", layout=layout))
        address = await receiver.start()
        try:
            receiver.expect("r")
            header = make_header("r", "m", layout, payload, "t", first_token=first)
            await LoopbackSender(hub).send(address, header, payload, timeout_s=10)
            got = await receiver.claim("r", timeout_s=10)
            return got.payload.copy()
        finally:
            await receiver.close()

    received = torch.from_numpy(asyncio.run(ship())).view(torch.float32)
    p_eng.release_kv("r")
    d_eng.add_prefilled_request(
        "r", prompt, first, GREEDY, received.view(export.payload.shape), first_block=0
    )
    assert run_to_end(d_eng)["r"] == expected
    d_eng.block_pool.check_no_leaks()


def test_first_token_logprobs_come_with_the_handoff(model_dir: Path) -> None:
    """The prefill engine's export carries the first token's logprobs (its sampler's);
    the decode engine reports them first, so every token has one, equal to colocated's.
    A request that wants logprobs but arrives without them is refused, holding nothing."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    first_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=3)
    prompt = prompts()[3]
    colocated = engine(model_dir)
    colocated.add_request("r", prompt, params)
    ref = None
    while colocated.has_unfinished:
        for out in colocated.step():
            ref = out
    assert ref is not None and ref.logprobs is not None

    p_eng, d_eng = engine(model_dir), engine(model_dir)
    p_eng.add_request("r", prompt, first_params, hold_kv=True)
    run_to_end(p_eng)
    export = p_eng.export_kv("r")
    p_eng.release_kv("r")
    assert export.first_logprobs is not None
    assert export.first_logprobs == ref.logprobs[0]  # same sampler, same logits
    for lacking in (None, dataclasses.replace(export.first_logprobs, top=())):
        with pytest.raises(KVImportError, match="logprobs"):
            d_eng.add_prefilled_request(
                "r", prompt, export.first_token, params, export.payload, first_logprobs=lacking
            )
    assert not d_eng.has_unfinished
    d_eng.block_pool.check_no_leaks()

    first = d_eng.add_prefilled_request(
        "r",
        prompt,
        export.first_token,
        params,
        export.payload,
        first_logprobs=export.first_logprobs,
    )
    assert first.logprobs == [export.first_logprobs]
    outs = [first]
    while d_eng.has_unfinished:
        outs += d_eng.step()
    for out in outs:  # what a stream sends: one logprob per token so far
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    got = outs[-1].logprobs
    assert got is not None and outs[-1].token_ids == ref.token_ids
    for a, b in zip(got, ref.logprobs, strict=True):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
    d_eng.block_pool.check_no_leaks()
    p_eng.block_pool.check_no_leaks()
