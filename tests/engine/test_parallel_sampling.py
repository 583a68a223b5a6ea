"""Parallel sampling (`n` > 1): the choices fork over one computed prompt.

A fork shares the parent's prompt blocks (ref counts, no recompute of them), and choice i
of a seeded n-request returns exactly what a separate request seeded `seed + i` does,
whether the parent prefilled here (colocated) or arrived with its KV (disaggregated).
Blocks balance afterwards, also when a choice is aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine

BLOCK = 4
N = 4
SEED = 1234
PARAMS = SamplingParams(max_tokens=12, temperature=1.0, seed=SEED, ignore_eos=True, n=N)
PREFILL = SamplingParams(max_tokens=1, temperature=1.0, seed=SEED, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    return Path(make_checkpoint(num_heads=4, num_kv_heads=2))


def engine(model_dir: Path, caching: bool = True) -> LLMEngine:
    config = EngineConfig(
        dtype="float32", block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=caching
    )
    return LLMEngine(model_dir, config)


def prompt(length: int) -> list[int]:
    rng = random.Random(length)
    return [rng.randrange(3, 512) for _ in range(length)]


def run_to_end(eng: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for out in eng.step():
            tokens[out.request_id] = out.token_ids
    return tokens


def separate(model_dir: Path, ids: list[int]) -> list[list[int]]:
    """Each choice as an n = 1 request of its derived seed, on an engine of its own."""
    results = []
    for i in range(N):
        eng = engine(model_dir, caching=False)
        eng.add_request("r", ids, PARAMS.choice_params(i))
        results.append(run_to_end(eng)["r"])
    return results


@pytest.mark.parametrize("length", [13, 16])  # a partial last block, a full one
def test_forked_choices_equal_separate_seeded_requests(model_dir: Path, length: int) -> None:
    ids = prompt(length)
    expected = separate(model_dir, ids)
    assert len({tuple(t) for t in expected}) > 1  # the seeds do differ

    eng = engine(model_dir, caching=False)  # sharing must not rest on the prefix cache
    eng.add_request("r", ids, PARAMS.choice_params(0))
    for i in range(1, N):
        eng.fork_request("r", f"r-c{i}", PARAMS.choice_params(i))
    assert len(eng.scheduler.running) == 0  # forks wait for the parent's prompt
    outs = eng.step()  # the whole prompt in one step
    assert [o.request_id for o in outs] == ["r"]
    # the step that computed the prompt forked the choices over its blocks
    parent = eng._seqs["r"]
    num_shared = (length - 1) // BLOCK
    for i in range(1, N):
        child = eng._seqs[f"r-c{i}"]
        assert child.blocks == parent.blocks[:num_shared]
        assert child.num_computed_tokens == num_shared * BLOCK
    for block in parent.blocks[:num_shared]:
        assert block.ref_count == N
    got = run_to_end(eng)
    assert [got["r"], *(got[f"r-c{i}"] for i in range(1, N))] == expected
    eng.block_pool.check_no_leaks()


def test_fork_after_kv_import_equals_separate_requests(model_dir: Path) -> None:
    """Disaggregated: the parent arrives with its KV and first token; the choices fork at
    once, each computing only the prompt's last block and sampling its own first token."""
    ids = prompt(13)
    expected = separate(model_dir, ids)
    p_eng, d_eng = engine(model_dir), engine(model_dir)
    p_eng.add_request("r", ids, PREFILL, hold_kv=True)
    (first,) = run_to_end(p_eng)["r"]
    export = p_eng.export_kv("r")
    d_eng.add_prefilled_request("r", ids, first, PARAMS.choice_params(0), export.payload)
    p_eng.release_kv("r")
    for i in range(1, N):
        d_eng.fork_request("r", f"r-c{i}", PARAMS.choice_params(i))
    shared = d_eng._seqs["r"].blocks[: (13 - 1) // BLOCK]
    assert [b.ref_count for b in shared] == [N] * len(shared)
    got = run_to_end(d_eng)
    assert [got["r"], *(got[f"r-c{i}"] for i in range(1, N))] == expected
    d_eng.block_pool.check_no_leaks()
    p_eng.block_pool.check_no_leaks()


def test_aborts_free_every_block(model_dir: Path) -> None:
    eng = engine(model_dir)
    ids = prompt(13)
    eng.add_request("r", ids, PARAMS.choice_params(0))
    eng.fork_request("r", "r-c1", PARAMS.choice_params(1))
    eng.fork_request("r", "r-c2", PARAMS.choice_params(2))
    eng.abort(["r-c2"])  # before its fork: it never starts
    eng.step()  # the prompt: r-c1 forks
    assert set(eng._seqs) == {"r", "r-c1"}
    eng.step()
    eng.abort(["r"])  # the parent goes; the fork keeps the shared blocks
    assert eng._seqs["r-c1"].blocks[0].ref_count == 1
    run_to_end(eng)
    eng.block_pool.check_no_leaks()
    # a parent aborted before its prompt is computed takes its waiting forks along
    eng.add_request("q", ids, PARAMS.choice_params(0))
    eng.fork_request("q", "q-c1", PARAMS.choice_params(1))
    eng.abort(["q"])
    assert not eng.has_unfinished and not eng._forks
    eng.block_pool.check_no_leaks()


def test_bad_forks_are_refused(model_dir: Path) -> None:
    eng = engine(model_dir)
    with pytest.raises(InvalidRequestError, match="not running"):
        eng.fork_request("nobody", "x", PARAMS.choice_params(1))
    eng.add_request("r", prompt(9), PARAMS.choice_params(0))
    with pytest.raises(InvalidRequestError, match="already running"):
        eng.fork_request("r", "r", PARAMS.choice_params(1))
    salted = SamplingParams(seed=1, cache_salt="tenant")
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        eng.fork_request("r", "r-c1", salted)
    with pytest.raises(InvalidRequestError, match="n must be"):
        SamplingParams(n=0)
    eng.abort(["r"])
    eng.block_pool.check_no_leaks()


def test_a_choice_stream_left_early_aborts_every_choice(model_dir: Path) -> None:
    """The decode worker's one stream for n choices (`AsyncEngine.stream(choices=...)`):
    outputs of every choice come on it, and a caller that goes away (the client did)
    aborts those still running: every block comes back."""
    eng = engine(model_dir)
    params = dataclasses.replace(PARAMS, max_tokens=200)
    ids = prompt(13)
    children = [f"r-c{i}" for i in range(1, N)]

    def start(e: LLMEngine) -> None:
        e.add_request("r", ids, params.choice_params(0), stream=True)
        for i, child in enumerate(children, start=1):
            e.fork_request("r", child, params.choice_params(i), True)

    async def run() -> set[str]:
        async_engine = AsyncEngine(eng)
        seen: set[str] = set()
        try:
            stream = async_engine.stream("r", start, choices=children)
            async for out in stream:
                seen.add(out.request_id)
                if len(seen) == N:
                    break
            await stream.aclose()
            # commands run in order between steps: the abort came before this one
            assert not await async_engine.call(lambda e: e.has_unfinished)
        finally:
            await async_engine.close()
        return seen

    assert asyncio.run(run()) == {"r", *children}
    eng.block_pool.check_no_leaks()


def test_each_forked_choice_keeps_to_the_grammar(model_dir: Path) -> None:
    """A constrained request's choices each walk the grammar with a matcher of their own."""
    from pdserve.common.grammar import GrammarSpec

    words = ["alpha", "beta", "gamma", "delta"]
    params = dataclasses.replace(
        PARAMS, ignore_eos=False, max_tokens=32, grammar=GrammarSpec.choice(words)
    )
    eng = engine(model_dir, caching=False)
    eng.add_request("r", prompt(13), params.choice_params(0))
    for i in range(1, N):
        eng.fork_request("r", f"r-c{i}", params.choice_params(i))
    texts: dict[str, str] = {}
    while eng.has_unfinished:
        for out in eng.step():
            if out.finished:
                texts[out.request_id] = eng.tokenizer.decode(out.token_ids)
    assert len(texts) == N and all(text in words for text in texts.values()), texts
    eng.block_pool.check_no_leaks()
