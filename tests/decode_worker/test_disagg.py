"""Prefill worker -> decode worker over a KV transport, in one process (no Ray yet).

Each request goes the way the router will send it: the decode worker expects the KV,
the prefill worker prefills and pushes, the decode worker streams. Tokens (and logprobs,
the first token's computed on the prefill side) must equal the colocated engine's; a
prefill that never pushes, or pushes KV of another model or prompt, falls back to local
prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.hashing import hash_block_chain
from pdserve.decode_worker.worker import DecodeWorker, choice_id
from pdserve.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.kv_transfer.base import ReceiverConfig
from pdserve.kv_transfer.errors import KVMismatchError
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


def new_engine(model_dir: Path, model_id: str | None = None) -> LLMEngine:
    config = EngineConfig(dtype="float32", block_size=8, num_kv_blocks=64, model_id=model_id)
    return LLMEngine(model_dir, config)


def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)


def colocated_outputs(
    model_dir: Path, params: Callable[[int], SamplingParams]
) -> list[RequestOutput]:
    eng = new_engine(model_dir)
    for i, prompt in enumerate(prompts()):
        eng.add_request(f"r{i}", prompt, params(i))
    done: dict[str, RequestOutput] = {}
    while eng.has_unfinished:
        for out in eng.step():
            done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts()))]


def colocated_tokens(model_dir: Path, sampled: bool = False) -> list[list[int]]:
    outs = colocated_outputs(model_dir, seeded if sampled else lambda i: GREEDY)
    return [out.token_ids for out in outs]


async def collect(stream: Any) -> RequestOutput:
    """The last output of a stream; every output (what a stream sends) must carry one
    logprob per token so far when the request asked for logprobs."""
    last: RequestOutput | None = None
    async for out in stream:
        if out.logprobs is not None:
            assert len(out.logprobs) == len(out.token_ids), out
        last = out
    assert last is not None
    return last


KV_ARRIVES_WITHIN_S = 60.0


async def serve_outputs(
    model_dir: Path,
    push: bool,
    params: Callable[[int], SamplingParams],
    prefill_model_id: str | None = None,
    prefill_prompt: Callable[[list[int]], list[int]] = list,
) -> tuple[list[RequestOutput], int, list[int]]:
    """Serve `prompts()` disaggregated; (final outputs, local fallbacks, blocks sent).

    `prefill_model_id` / `prefill_prompt`: what the prefill side uses instead of the
    decode side's model id / the request's prompt (a mixed-up push).
    """
    hub = LoopbackHub()
    p_eng = new_engine(model_dir, prefill_model_id)
    p_async, d_async = AsyncEngine(p_eng), AsyncEngine(new_engine(model_dir))
    layout = layout_of(d_async.engine.runner.kv_cache)
    # Expected KV that will come gets a wait no loaded CI machine outlasts (a first prefill
    # there took over 0.5 s, the push then found its request gone); KV that will not come
    # (push=False) is waited out briefly, once per prompt.
    wait_s = KV_ARRIVES_WITHIN_S if push else 0.5
    decode = DecodeWorker(
        d_async, LoopbackReceiver(hub, ReceiverConfig(TOKEN, layout)), kv_wait_timeout_s=wait_s
    )
    prefill = PrefillWorker(p_async, LoopbackSender(hub), TOKEN)
    address = await decode.start()
    results, sent = [], []
    try:
        for i, prompt in enumerate(prompts()):  # dual dispatch, as the router will
            rid = f"r{i}"
            decode.expect_kv(rid, prompt)
            stream = collect(decode.generate(rid, prompt, params(i), kv_expected=True))
            if push:
                pushed = prefill.prefill(rid, prefill_prompt(prompt), params(i), address)
                out, result = await asyncio.gather(stream, pushed)
                assert out.token_ids[0] == result.first_token
                sent.append(result.num_blocks_sent)
            else:
                out = await stream
            results.append(out)
        assert decode.receiver.num_pending == 0
        for eng in (p_async.engine, d_async.engine):
            eng.block_pool.check_no_leaks()
        return results, decode.num_local_fallbacks, sent
    finally:
        await decode.close()
        await p_async.close()
        await d_async.close()


async def serve_all(
    model_dir: Path, push: bool, sampled: bool = False
) -> tuple[list[list[int]], int, list[int]]:
    params = seeded if sampled else lambda i: GREEDY
    outs, fallbacks, sent = await serve_outputs(model_dir, push, params)
    return [out.token_ids for out in outs], fallbacks, sent


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


def test_logprobs_of_every_token_cross_the_split(model_dir: Path) -> None:
    """The first token's logprob and top-2 come from the prefill worker's sampler; the
    decode worker reports them first, so every token has one, equal to colocated's."""
    params = dataclasses.replace(GREEDY, logprobs=2)
    run = serve_outputs(model_dir, True, lambda i: params)
    outs, fallbacks, _ = asyncio.run(asyncio.wait_for(run, 120))
    assert fallbacks == 0  # the split really happened: no local prefill
    want = colocated_outputs(model_dir, lambda i: params)
    for out, ref in zip(outs, want, strict=True):
        assert out.token_ids == ref.token_ids
        assert out.logprobs is not None and ref.logprobs is not None
        assert len(out.logprobs) == len(out.token_ids) == GREEDY.max_tokens
        for got, exp, token in zip(out.logprobs, ref.logprobs, out.token_ids, strict=True):
            assert got.token_id == exp.token_id == token
            assert got.logprob == pytest.approx(exp.logprob, abs=1e-5)
            assert len(got.top) == 2
            assert [t for t, _ in got.top] == [t for t, _ in exp.top]
            assert [v for _, v in got.top] == pytest.approx([v for _, v in exp.top], abs=1e-5)
            assert got.top[0][0] == token  # greedy: the most likely token was chosen


def _change_first_block(prompt: list[int]) -> list[int]:
    return [prompt[0] + 1, *prompt[1:]]


@contextlib.asynccontextmanager
async def disagg_pair(
    model_dir: Path, kv_wait_s: float = 5.0
) -> AsyncIterator[tuple[DecodeWorker, PrefillWorker, str]]:
    """A decode and a prefill worker on engines of their own, joined by a loopback hub:
    (decode, prefill, the decode receiver's address). Leaving the block checks that
    neither engine leaked a block, and closes both."""
    hub = LoopbackHub()
    p_async, d_async = AsyncEngine(new_engine(model_dir)), AsyncEngine(new_engine(model_dir))
    layout = layout_of(d_async.engine.runner.kv_cache)
    receiver = LoopbackReceiver(hub, ReceiverConfig(TOKEN, layout))
    decode = DecodeWorker(d_async, receiver, kv_wait_timeout_s=kv_wait_s)
    prefill = PrefillWorker(p_async, LoopbackSender(hub), TOKEN)
    try:
        yield decode, prefill, await decode.start()
        for e in (p_async.engine, d_async.engine):
            e.block_pool.check_no_leaks()
    finally:
        await decode.close()
        await p_async.close()
        await d_async.close()


@pytest.mark.parametrize("mixed_up", ["model", "prompt"])
def test_kv_of_another_model_or_prompt_is_refused_then_prefilled_here(
    model_dir: Path, mixed_up: str
) -> None:
    """The receiver checks the push's model id and block hashes against the request it
    expects: a mismatch fails the push (KVMismatchError) and the decode worker prefills
    locally, so the tokens stay right."""
    greedy: Callable[[int], SamplingParams] = lambda i: GREEDY  # noqa: E731
    full_prompts = [p for p in prompts() if len(p) >= 8]  # a full block: hashes to compare

    async def run() -> None:
        hub = LoopbackHub()
        p_eng = new_engine(model_dir, "another-model" if mixed_up == "model" else None)
        p_async, d_async = AsyncEngine(p_eng), AsyncEngine(new_engine(model_dir))
        layout = layout_of(d_async.engine.runner.kv_cache)
        receiver = LoopbackReceiver(hub, ReceiverConfig(TOKEN, layout))
        decode = DecodeWorker(d_async, receiver, kv_wait_timeout_s=5.0)
        prefill = PrefillWorker(p_async, LoopbackSender(hub), TOKEN)
        address = await decode.start()
        try:
            for i, prompt in enumerate(full_prompts):
                rid = f"r{i}"
                decode.expect_kv(rid, prompt)
                sent = _change_first_block(prompt) if mixed_up == "prompt" else prompt
                with pytest.raises(KVMismatchError):
                    await prefill.prefill(rid, sent, GREEDY, address)
                # refused at once: the claim fails now, not after kv_wait_timeout_s
                out = await asyncio.wait_for(
                    collect(decode.generate(rid, prompt, GREEDY, kv_expected=True)), 4.0
                )
                assert out.token_ids == want[prompts().index(prompt)]
            assert decode.num_local_fallbacks == len(full_prompts)
            assert receiver.num_pending == 0 and receiver.core.num_buffered_bytes == 0
            for eng in (p_async.engine, d_async.engine):
                eng.block_pool.check_no_leaks()
        finally:
            await decode.close()
            await p_async.close()
            await d_async.close()

    want = [out.token_ids for out in colocated_outputs(model_dir, greedy)]
    asyncio.run(asyncio.wait_for(run(), 120))


def test_a_prefill_worker_warms_up_with_a_measured_rate_and_holds_nothing(model_dir: Path) -> None:
    async def run() -> tuple[float | None, dict[str, int]]:
        p_async = AsyncEngine(new_engine(model_dir))
        try:
            prefill = PrefillWorker(p_async, LoopbackSender(LoopbackHub()), TOKEN)
            assert prefill.rate.tokens_per_s is None
            rate = await prefill.warm_up(100)
            assert rate == prefill.rate.tokens_per_s
            return rate, await p_async.call(lambda e: e.load())
        finally:
            await p_async.close()

    rate, load = asyncio.run(run())
    assert rate is not None and rate > 0
    assert (load["running"], load["waiting"]) == (0, 0)


def test_salted_kv_crosses_only_to_a_request_of_the_same_salt(model_dir: Path) -> None:
    """The handoff matches blocks by the request's salted hashes on both sides: a push
    of the same prompt under another salt is refused (KVMismatchError, then a local
    prefill), the same salt is taken, and the decode worker's cache then holds the
    prompt's blocks under that salt's hashes only."""
    prompt = prompts()[2]  # 67 tokens: 8 full blocks
    salted = dataclasses.replace(GREEDY, cache_salt="tenant-a")

    async def run() -> None:
        async with disagg_pair(model_dir) as (decode, prefill, address):
            decode.expect_kv("r0", prompt, cache_salt="tenant-a")
            other = dataclasses.replace(GREEDY, cache_salt="tenant-b")
            with pytest.raises(KVMismatchError):
                await prefill.prefill("r0", prompt, other, address)
            out = await collect(decode.generate("r0", prompt, salted, kv_expected=True))
            assert out.token_ids == want and decode.num_local_fallbacks == 1

            decode.expect_kv("r1", prompt, cache_salt="tenant-a")
            stream = collect(decode.generate("r1", prompt, salted, kv_expected=True))
            pushed = prefill.prefill("r1", prompt, salted, address)
            out, result = await asyncio.gather(stream, pushed)
            assert out.token_ids == want and decode.num_local_fallbacks == 1  # KV used
            assert result.num_cached_tokens == 0  # tenant-b's blocks are not tenant-a's
            eng = decode.engine.engine
            cached = set(eng.block_pool.cached_hashes())
            for salt, held in (("tenant-a", True), ("tenant-b", False), (None, False)):
                chain = hash_block_chain(prompt, 8, eng.namespace_for(salt))
                assert (set(chain) <= cached) is held and bool(set(chain) & cached) is held

    (want,) = [o.token_ids for o in colocated_outputs(model_dir, lambda i: GREEDY)][2:3]
    asyncio.run(asyncio.wait_for(run(), 120))


def test_an_adapters_kv_crosses_under_its_own_model_id(model_dir: Path, tmp_path: Path) -> None:
    """A LoRA request's KV crosses under its adapter's model id (`kv_model_id`), which
    the receiver checks before the hashes: a push of the base model's KV of the same
    prompt is refused as another model's, the adapter's own push is taken."""
    from tests.engine.test_lora import _make_adapter

    adapter = _make_adapter(model_dir, tmp_path / "qv", 4, 8, ["q_proj", "v_proj"], False, 1)
    prompt = prompts()[2]
    lora = dataclasses.replace(GREEDY, lora="qv")

    async def run() -> None:
        async with disagg_pair(model_dir) as (decode, prefill, address):
            for worker in (decode, prefill):
                worker.engine.engine.load_lora("qv", adapter)
            decode.expect_kv("r0", prompt, lora="qv")
            with pytest.raises(KVMismatchError, match="KV of model 'ckpt"):
                await prefill.prefill("r0", prompt, GREEDY, address)  # the base's KV
            out = await collect(decode.generate("r0", prompt, lora, kv_expected=True))
            assert decode.num_local_fallbacks == 1

            decode.expect_kv("r1", prompt, lora="qv")
            stream = collect(decode.generate("r1", prompt, lora, kv_expected=True))
            pushed = prefill.prefill("r1", prompt, lora, address)
            again, _ = await asyncio.gather(stream, pushed)
            assert decode.num_local_fallbacks == 1  # the adapter's own KV: taken
            assert again.token_ids == out.token_ids

    asyncio.run(asyncio.wait_for(run(), 120))


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_choices_of_a_request_whose_first_choice_ends_at_its_first_token(
    model_dir: Path, max_tokens: int
) -> None:
    """n > 1 with the prompt's KV pushed: choice 0 arrives with its first token, and with
    max_tokens 1 that token ends it at once, leaving nothing to fork the other choices
    from. They are then requests of the same prompt (its blocks cached), each exactly a
    separate request of its own seed, as a fork is; never an error (which the router
    took for a broken decode worker and resumed: CI's fuzz test saw it)."""
    prompt = prompts()[2]
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7, ignore_eos=True, n=3)

    async def run() -> tuple[dict[str, list[int]], int]:
        done: dict[str, list[int]] = {}
        async with disagg_pair(model_dir, kv_wait_s=60) as (decode, prefill, address):

            async def consume() -> None:
                async for out in decode.generate("r", prompt, params, kv_expected=True):
                    if out.finished:
                        done[out.request_id] = out.token_ids

            decode.expect_kv("r", prompt)
            await asyncio.gather(consume(), prefill.prefill("r", prompt, params, address))
        return done, decode.num_local_fallbacks

    done, fallbacks = asyncio.run(asyncio.wait_for(run(), 120))
    assert fallbacks == 0  # choice 0 used the pushed KV
    want = {}
    for i in range(3):
        eng = new_engine(model_dir)
        eng.add_request("s", prompt, params.choice_params(i))
        while eng.has_unfinished:
            for out in eng.step():
                want[choice_id("r", i)] = out.token_ids
    assert done == want
