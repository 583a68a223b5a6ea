"""Speculative decoding with prompt-lookup proposals (engine/spec_decode/proposer.py).

Greedy tokens with speculation must equal `transformers`' (and so the engine's without
it) through every engine path; seeded sampled tokens equal the engine's without it (the
verify rows draw decoding's own numbers); the acceptance rule's output distribution is
the target's (a chi-square test over a small vocabulary); rejected proposals leave no
trace in the KV pool or the prefix cache.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from pdserve.common.hashing import ROOT_HASH, hash_block_chain, hash_namespace
from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampler import Sampler
from pdserve.engine.sched.block_pool import BlockPool
from pdserve.engine.sched.kv_cache_manager import KVCacheManager
from pdserve.engine.sched.scheduler import ScheduledSeq, Scheduler, SchedulerLimits, SchedulerOutput
from pdserve.engine.sched.sequence import Sequence
from pdserve.engine.spec_decode.proposer import (
    NgramProposer,
    SpecPolicy,
    SpeculativeConfig,
    accept,
    propose_from,
)
from pdserve.engine.worker.model_runner import sample_step

MAX_TOKENS = 32
NS = hash_namespace("test-model")


# -- configuration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "k", "n"),
    [("ngram", 4, 3), ("ngram:k=1", 1, 3), ("ngram:k=8,n=1", 8, 1), (" ngram : n=5 , k=2 ", 2, 5)],
)
def test_speculative_config_parses(spec: str, k: int, n: int) -> None:
    config = EngineConfig(speculative=spec).speculative_config
    assert config == SpeculativeConfig("ngram", k, n, adaptive=True)
    assert EngineConfig().speculative_config is None
    off = EngineConfig(speculative="ngram:k=2,adaptive=off").speculative_config
    assert off == SpeculativeConfig("ngram", 2, 3, adaptive=False)
    assert SpeculativeConfig.parse("ngram:adaptive=ON").adaptive


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ngram:k=0", r"k \(tokens proposed per step\) must be in 1\.\.8, got 0"),
        ("ngram:k=9", "must be in 1..8, got 9"),
        ("ngram:n=0", r"n \(longest n-gram matched\) must be in 1\.\.16, got 0"),
        ("ngram:k=four", "k must be an integer, got 'four'"),
        ("ngram:m=2", "expected k=K, n=N or adaptive=on|off, got 'm=2'"),
        ("ngram:k", "expected k=K, n=N or adaptive=on|off, got 'k'"),
        ("ngram:adaptive=maybe", "adaptive must be on or off, got 'maybe'"),
        ("ngram:adaptive=on,adaptive=off", "adaptive is given twice"),
        ("ngram:k=2,k=3", "k is given twice"),
        ("medusa:k=2", "unknown method 'medusa'"),
        ("draft:k=4", "the draft model's folder must come first"),
    ],
)
def test_speculative_config_refuses_clearly(spec: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EngineConfig(speculative=spec)


# -- the proposer ----------------------------------------------------------------------


def scan_proposal(tokens: list[int], n: int, k: int) -> list[int]:
    """The definition, by brute force: for j = n..1 the most recent earlier occurrence
    of the last j tokens; the k tokens after it, the copy continuing past the end."""
    length = len(tokens)
    for j in range(min(n, length - 1), 0, -1):
        suffix = tokens[length - j :]
        for start in range(length - j - 1, -1, -1):
            if tokens[start : start + j] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + j + i])
                return extended[length:]
    return []


def test_proposer_examples() -> None:
    assert propose_from([5, 6, 7], [], 3, 4) == []
    tokens = [1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3]
    proposer = NgramProposer(4, 3)
    seq = Sequence("r", tokens, SamplingParams(), frozenset(), NS)
    assert proposer.propose(seq, 4) == [9, 2, 3, 4]  # the 3-gram (1, 2, 3) wins over (2, 3)
    assert proposer.propose(seq, 2) == [9, 2]
    seq.append_token(9)  # (3, 9) matched at 2..3; (1, 2, 3, 9) is too long for n=3
    assert proposer.propose(seq, 3) == [2, 3, 4]
    # A repeating tail: the copy goes on from its own start.
    periodic = Sequence("p", [4, 7, 8, 7, 8], SamplingParams(), frozenset(), NS)
    assert proposer.propose(periodic, 5) == [7, 8, 7, 8, 7]


def test_proposer_equals_the_definition_on_random_sequences() -> None:
    rng = random.Random(0)
    for trial in range(300):
        n, k, vocab = rng.randint(1, 4), rng.randint(1, 6), rng.randint(2, 12)
        proposer = NgramProposer(k, n)
        seq = Sequence(f"r{trial}", [rng.randrange(vocab)], SamplingParams(), frozenset(), NS)
        for _ in range(rng.randint(1, 60)):  # grown a token at a time, like a decode
            assert proposer.propose(seq, k) == scan_proposal(seq.all_token_ids, n, k)
            seq.append_token(rng.randrange(vocab))


# -- the acceptance rule ---------------------------------------------------------------


def test_accept_keeps_the_agreeing_prefix_and_the_target_after_it() -> None:
    assert accept([7], []) == [7]
    assert accept([1, 2, 3, 4], [1, 2, 3]) == [1, 2, 3, 4]  # all accepted + bonus
    assert accept([1, 5, 3, 4], [1, 2, 3]) == [1, 5]  # the target's token at the mismatch
    assert accept([6, 2, 3, 4], [1, 2, 3]) == [6]


# -- the scheduler: slots, budget, rollback --------------------------------------------


class FixedProposer:
    """Proposes `tokens` (cut to what the scheduler allows) for the request ids given."""

    def __init__(self, tokens: list[int], request_ids: set[str], k: int = 4) -> None:
        self.tokens = tokens
        self.request_ids = request_ids
        self.num_speculative_tokens = k

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        return self.tokens[:max_tokens] if seq.request_id in self.request_ids else []


def _decoding(sched: Scheduler, *seqs: Sequence) -> None:
    """Prefill `seqs` in one step (each samples a first token 7)."""
    budget = sched.limits.max_num_batched_tokens
    sched.limits.max_num_batched_tokens = 1024
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert len(out.prefills) == len(seqs)
    sched.update(out, {s.request_id: 7 for s in seqs})
    sched.limits.max_num_batched_tokens = budget


def test_verify_rows_take_spare_budget_and_reserve_slots() -> None:
    pool = BlockPool(32, enable_caching=True)
    limits = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=6, max_model_len=64)
    proposer = FixedProposer([11, 12, 13, 14], {"a", "b"})
    sched = Scheduler(KVCacheManager(pool, 4), limits, proposer=proposer)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    a, b, c = (Sequence(r, [1, 2, 3], params, frozenset(), NS) for r in "abc")
    _decoding(sched, a, b, c)
    out = sched.schedule()
    # Every decode first (3 tokens of 6), then proposals from what is left: 3 for a.
    assert [(v.seq.request_id, v.num_new_tokens, v.spec_token_ids) for v in out.verifies] == [
        ("a", 4, (11, 12, 13))
    ]
    assert [d.seq.request_id for d in out.decodes] == ["b", "c"]
    assert out.num_tokens == 6
    assert len(a.blocks) == 2  # positions 3..6: slots reserved past the first block
    # The target agrees with 11 only: a gets 11 and the target's 50; its computed tokens
    # end after 11 (positions 0..4) and the block of rejected slots only is kept (it
    # holds the next token's slot).
    finished = sched.update(out, {"a": [11, 50], "b": [8], "c": [8]})
    assert not finished
    assert a.output_token_ids == [7, 11, 50]
    assert a.num_computed_tokens == 5 and a.num_tokens == 6
    assert len(a.blocks) == 2
    assert sched.spec_stats.gauges() == {
        "spec_proposed_tokens": 3,
        "spec_accepted_tokens": 1,
        "spec_emitted_tokens": 2,
        "spec_verify_rows": 1,
        "spec_verify_steps": 1,
        "spec_withheld_tokens": 0,
    }


def test_rejected_slots_go_back_to_the_pool_first_in_line() -> None:
    pool = BlockPool(16, enable_caching=True)
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    sched = Scheduler(KVCacheManager(pool, 4), limits, proposer=FixedProposer([9] * 8, {"a"}, 8))
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=30, temperature=0.0), frozenset(), NS)
    _decoding(sched, a)
    out = sched.schedule()
    assert out.verifies[0].num_new_tokens == 9  # positions 3..11: blocks 0, 1, 2
    assert len(a.blocks) == 3
    third = a.blocks[2]
    sched.update(out, {"a": [5]})  # the first proposal is rejected
    assert a.num_computed_tokens == 4 and a.num_tokens == 5
    assert len(a.blocks) == 2 and third.ref_count == 0 and third.block_hash is None
    assert pool.allocate(1) == [third]  # reused before any other free block


def test_speculation_never_preempts() -> None:
    pool = BlockPool(2, enable_caching=False)
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=8)
    sched = Scheduler(KVCacheManager(pool, 4), limits, proposer=FixedProposer([9] * 4, {"a"}))
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0), frozenset(), NS)
    b = Sequence("b", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0), frozenset(), NS)
    _decoding(sched, a, b)
    out = sched.schedule()  # a's proposals would need a third block: decoded plainly
    assert not out.verifies and not out.preempted and len(out.decodes) == 2


def test_proposals_stop_at_max_tokens_and_the_context() -> None:
    pool = BlockPool(32, enable_caching=False)
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=9)
    proposer = FixedProposer([9] * 8, {"a", "b"}, 8)
    sched = Scheduler(KVCacheManager(pool, 4), limits, proposer=proposer)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0), frozenset(), NS)
    b = Sequence("b", [1, 2], SamplingParams(max_tokens=30, temperature=0.0), frozenset(), NS)
    _decoding(sched, a, b)
    out = sched.schedule()
    # a: 2 more tokens may come, so 1 proposal; b: 3 tokens of 9, 6 more fit: 5 proposals
    # (and the target's token after them).
    assert {v.seq.request_id: len(v.spec_token_ids) for v in out.verifies} == {"a": 1, "b": 5}


def test_a_stop_inside_the_accepted_tokens_drops_the_rest() -> None:
    pool = BlockPool(16, enable_caching=True)
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    sched = Scheduler(KVCacheManager(pool, 4), limits, proposer=FixedProposer([4, 5, 6], {"a"}))
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[5])
    a = Sequence("a", [1, 2, 3], params, frozenset(), NS)
    _decoding(sched, a)
    out = sched.schedule()
    assert out.verifies[0].spec_token_ids == (4, 5, 6)
    seen: list[tuple[int, int]] = []
    finished = sched.update(out, {"a": [4, 5, 6, 8]}, lambda s, i, t: seen.append((i, t)) or False)
    assert finished == [a] and a.finish_reason is not None and a.finish_reason.value == "stop"
    assert a.output_token_ids == [7, 4, 5] and seen == [(0, 4), (1, 5)]
    assert sched.spec_stats.accepted_tokens == 3 and sched.spec_stats.emitted_tokens == 2
    pool.check_no_leaks()


# -- the adaptive policy ---------------------------------------------------------------


class FakeCost:
    """A step cost model's coefficients: (step, decode row, decode context, prefill token,
    prefill query-key pair) seconds."""

    def __init__(self, coefficients: tuple[float, ...] | None) -> None:
        self.decode_coefficients = coefficients


def _policy_seq() -> Sequence:
    return Sequence("p", [1, 2, 3], SamplingParams(), frozenset(), NS)


def test_policy_verifies_what_pays_for_itself() -> None:
    seq = _policy_seq()
    # 8 decode rows of 100 tokens of context; a step costs 8 ms plus `d` per row, and a
    # chunk's token costs what a decode row does.
    decode_step = (1.0, 8.0, 800.0, 0.0, 0.0)

    def policy(d: float) -> SpecPolicy:
        made = SpecPolicy(FakeCost((8e-3, d, 0.0, d, 0.0)))
        made.begin_step(decode_step, 8)
        return made

    assert SpecPolicy(FakeCost(None)).length(seq, 100, 4) == 4  # no fit yet: all
    assert policy(1e-5).alpha(seq) == 0.5
    assert policy(1e-5).length(seq, 100, 4) == 4  # a proposal costs 0.01 token
    assert policy(2e-3).length(seq, 100, 4) == 0  # 0.67 token: never worth it at 0.5
    assert policy(2.5e-4).length(seq, 100, 4) == 2  # 0.2 token: alpha^i >= 0.2 for i <= 2


def test_policy_follows_each_sequences_acceptance() -> None:
    seq, other = _policy_seq(), _policy_seq()
    policy = SpecPolicy(FakeCost((8e-3, 2.5e-4, 0.0, 2.5e-4, 0.0)))
    policy.begin_step((1.0, 8.0, 800.0, 0.0, 0.0), 8)  # a proposal costs 0.2 token
    for _ in range(8):
        policy.observe(seq, 4, 0)  # rejected at once, again and again
    assert policy.alpha(seq) < 0.2 and policy.length(seq, 100, 4) == 0
    assert policy.length(other, 100, 4) == 2  # the other sequence keeps its own
    for _ in range(4):  # withheld proposals whose first token turns out right
        policy.withhold(seq, 42)
        policy.shadow(seq, 42)
    assert policy.alpha(seq) > 0.6 and policy.length(seq, 100, 4) >= 3
    policy.withhold(seq, 42)
    policy.shadow(seq, 7)  # and one that was wrong
    policy.shadow(seq, 7)  # nothing pending any more: no second observation
    assert 0.5 < policy.alpha(seq) < 0.6


# -- the engine: greedy tokens ----------------------------------------------------------


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (proposals from the prompt, and random models' outputs that
    fall into loops) and random ones (proposals mostly rejected)."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731 - skip specials
    phrase, shared = ids(9), ids(20)
    return [
        phrase * 4,
        shared + phrase * 2 + shared[:5],
        shared + ids(7),
        ids(3) * 6 + ids(2),
        ids(1),
        ids(45),
        ids(17),
        shared + ids(30),
    ]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Any, hf_greedy: Any) -> tuple[Path, list[list[int]]]:
    model_dir = make_checkpoint()
    return model_dir, hf_greedy(model_dir, make_prompts(), MAX_TOKENS)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
MODES: dict[str, dict[str, Any]] = {
    "prefix-cache": {"enable_prefix_caching": True, "block_size": 4},
    "chunked-prefill": {"max_num_batched_tokens": 12, "block_size": 4},
    "no-prefix-cache": {"enable_prefix_caching": False},
}


def check_pool(engine: LLMEngine, outs: list[RequestOutput]) -> None:
    """No block leaked, and every block in the prefix cache holds tokens of some
    request's final sequence: none was registered with a proposal later rejected."""
    engine.block_pool.check_no_leaks()
    bs = engine.config.block_size
    valid = set()
    for out in outs:
        tokens = out.prompt_token_ids + out.token_ids
        valid.update(hash_block_chain(tokens, bs, engine.hash_namespace, ROOT_HASH))
    cached = set(engine.block_pool.cached_hashes())
    assert cached <= valid, f"{len(cached - valid)} cached blocks hold unaccepted tokens"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_tokens_equal_transformers(
    checkpoint: tuple[Path, list[list[int]]], k: int, mode: str
) -> None:
    model_dir, expected = checkpoint
    llm = LLM(model_dir, dtype="float32", speculative=f"ngram:k={k},adaptive=off", **MODES[mode])
    outs = llm.generate(make_prompts(), GREEDY)
    for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        assert out.token_ids == ref, f"prompt {i} diverged with k={k} in mode {mode}"
        assert out.finish_reason == "length"
    stats = llm.engine.spec_stats()
    assert stats.accepted_tokens > 0  # the repetitive prompts' proposals are accepted
    assert stats.accepted_tokens < stats.proposed_tokens  # and random ones rejected
    assert stats.emitted_tokens == stats.accepted_tokens + stats.verify_rows
    if mode == "chunked-prefill":
        assert llm.engine.scheduler.stats.num_chunked_prefill_steps > 0
    check_pool(llm.engine, outs)
    if mode == "prefix-cache":
        # The cached blocks' KV is the accepted tokens': prompts extended by their own
        # outputs hit the cache and go on exactly as before.
        again = [out.prompt_token_ids + out.token_ids[:13] for out in outs]
        params = SamplingParams(max_tokens=MAX_TOKENS - 13, temperature=0.0, ignore_eos=True)
        outs2 = llm.generate(again, params)
        assert sum(o.num_cached_tokens for o in outs2) > 0
        for out, ref in zip(outs2, expected, strict=True):
            assert out.token_ids == ref[13:]
        check_pool(llm.engine, outs + outs2)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_tokens_equal_through_each_cpu_backend(
    checkpoint: tuple[Path, list[list[int]]], backend: str
) -> None:
    model_dir, expected = checkpoint
    llm = LLM(
        model_dir, dtype="float32", attention_backend=backend, speculative="ngram:k=3,adaptive=off"
    )
    assert llm.engine.runner.backend.name == backend
    outs = llm.generate(make_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.spec_stats().accepted_tokens > 0
    check_pool(llm.engine, outs)


def test_preemption_mid_speculation(checkpoint: tuple[Path, list[list[int]]]) -> None:
    model_dir, expected = checkpoint
    llm = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=40,
        block_size=4,
        max_model_len=128,
        speculative="ngram:k=4,adaptive=off",
    )
    outs = llm.generate(make_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.spec_stats().accepted_tokens > 0
    check_pool(llm.engine, outs)


class OnlyFor:
    """A proposer that proposes for some requests only."""

    def __init__(self, inner: NgramProposer, request_ids: set[str]) -> None:
        self.inner = inner
        self.request_ids = request_ids
        self.num_speculative_tokens = inner.num_speculative_tokens

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        if seq.request_id not in self.request_ids:
            return []
        return self.inner.propose(seq, max_tokens)


def test_mixed_step_of_verify_rows_decodes_and_a_prefill(
    checkpoint: tuple[Path, list[list[int]]],
) -> None:
    """Some sequences propose, some do not, and a prompt prefills in the same steps."""
    model_dir, expected = checkpoint
    llm = LLM(model_dir, dtype="float32", block_size=4, speculative="ngram:k=4,adaptive=off")
    engine = llm.engine
    proposer = engine.scheduler.proposer
    assert isinstance(proposer, NgramProposer)
    engine.scheduler.proposer = OnlyFor(proposer, {"p0", "p1", "p3"})
    shapes: list[tuple[int, int, int]] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        shapes.append((len(out.prefills), len(out.verifies), len(out.decodes)))
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    prompts = make_prompts()
    finals: dict[str, RequestOutput] = {}
    for i in range(4):
        engine.add_request(f"p{i}", prompts[i], GREEDY)
    for _ in range(4):
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    for i in range(4, len(prompts)):  # late arrivals prefill beside the decoding ones
        engine.add_request(f"p{i}", prompts[i], GREEDY)
    while engine.has_unfinished:
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [finals[f"p{i}"].token_ids for i in range(len(prompts))] == expected
    assert any(p and v and d for p, v, d in shapes), shapes
    check_pool(engine, list(finals.values()))


def test_triton_backend_verify_rows(make_checkpoint: Any) -> None:
    """Verify rows through the Triton kernels (paged prefill attention with context, KV
    writes), in Triton's interpreter on CPU: tiny, like tests/kernels/test_backend.py."""
    model_dir = make_checkpoint(hidden_size=64, num_heads=4, num_kv_heads=2)
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = LLM(model_dir, dtype="float32", attention_backend="torch").generate(prompts, params)
    llm = LLM(
        model_dir, dtype="float32", attention_backend="triton", speculative="ngram:k=3,adaptive=off"
    )
    assert llm.engine.runner.backend.name == "triton"
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.spec_stats().verify_rows > 0
    check_pool(llm.engine, got)


def test_cuda_graph_runner_takes_verify_rows(make_checkpoint: Any) -> None:
    """A step of verify rows and plain decodes is all decode rows: it replays through the
    CUDA graph runner's padded static buffers (eager replay on CPU, Triton interpreted)."""
    model_dir = make_checkpoint(hidden_size=64, num_heads=4, num_kv_heads=2)
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = LLM(model_dir, dtype="float32", attention_backend="torch").generate(prompts, params)
    llm = LLM(
        model_dir,
        dtype="float32",
        attention_backend="triton",
        enforce_eager=True,
        speculative="ngram:k=3,adaptive=off",
    )
    runner = llm.engine.runner
    runner.capture_cuda_graphs(8, llm.engine.max_model_len, use_cuda_graph=False)
    assert runner.graphs is not None
    graph_verify_steps = 0
    execute = runner.execute

    def counting(out: SchedulerOutput) -> Any:
        nonlocal graph_verify_steps
        graphs = runner.graphs
        assert graphs is not None
        before = sum(graphs.steps.values())
        result = execute(out)
        graph_verify_steps += bool(out.verifies) and sum(graphs.steps.values()) > before
        return result

    runner.execute = counting  # type: ignore[method-assign]
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert graph_verify_steps > 0
    check_pool(llm.engine, got)


def test_tensor_parallel_verify_rows(checkpoint: tuple[Path, list[list[int]]]) -> None:
    """At TP=2 (2 CPU ranks over gloo) every rank runs the verify rows and the driver
    gathers the logits of all their positions."""
    model_dir, expected = checkpoint
    with LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=128,
        block_size=4,
        tensor_parallel_size=2,
        speculative="ngram:k=3,adaptive=off",
    ) as llm:
        outs = llm.generate(make_prompts(), GREEDY)
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.spec_stats().accepted_tokens > 0
        check_pool(llm.engine, outs)


@pytest.mark.parametrize("cost", ["measured", "cheap", "costly"])
def test_adaptive_speculation_keeps_the_tokens(
    checkpoint: tuple[Path, list[list[int]]], cost: str
) -> None:
    """The default adaptive policy only shortens proposals: the tokens stay exact, with
    the engine's own measured costs, with cheap proposals (all verified) and with costly
    ones (all withheld)."""
    model_dir, expected = checkpoint
    llm = LLM(model_dir, dtype="float32", speculative="ngram:k=4")
    policy = llm.engine.scheduler.spec_policy
    assert policy is not None and policy.cost is llm.engine.step_cost
    if cost != "measured":
        per_row = 1e-7 if cost == "cheap" else 1.0  # seconds per decode row (and token)
        policy.cost = FakeCost((1e-3, per_row, 0.0, per_row, 0.0))
    outs = llm.generate(make_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.spec_stats()
    if cost == "cheap":
        assert stats.withheld_tokens == 0 and stats.accepted_tokens > 0
    if cost == "costly":
        assert stats.verify_rows == 0 and stats.withheld_tokens > 0
    check_pool(llm.engine, outs)


# -- stops, lengths, logprobs, streaming -----------------------------------------------


def _streamed(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine.add_request("s", prompt, params, stream=True)
    outs = []
    while engine.has_unfinished:
        outs.extend(engine.step())
    return outs


def test_streaming_carries_several_tokens_per_step(
    checkpoint: tuple[Path, list[list[int]]],
) -> None:
    model_dir, expected = checkpoint
    llm = LLM(model_dir, dtype="float32", speculative="ngram:k=4,adaptive=off")
    outs = _streamed(llm.engine, make_prompts()[0], GREEDY)
    final = outs[-1]
    assert final.finished and final.token_ids == expected[0]
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids
    assert "".join(o.new_text for o in outs) == final.text
    assert max(len(o.new_token_ids) for o in outs) > 1
    assert final.text == llm.tokenizer.decode(expected[0])


def _multi_token_steps(engine: LLMEngine, prompt: list[int]) -> list[list[int]]:
    """The tokens each step added to one greedy request, with speculation."""
    return [o.new_token_ids for o in _streamed(engine, prompt, GREEDY)]


def test_stop_string_inside_an_accepted_run(checkpoint: tuple[Path, list[list[int]]]) -> None:
    """A stop string that completes in the middle of a step's tokens ends the request
    there, exactly as without speculation (same tokens, text and reason)."""
    model_dir, _ = checkpoint
    spec = LLM(model_dir, dtype="float32", speculative="ngram:k=5,adaptive=off")
    plain = LLM(model_dir, dtype="float32")
    tok = spec.tokenizer
    tried = 0
    for prompt in make_prompts():
        steps = _multi_token_steps(spec.engine, prompt)
        tokens = [t for step in steps for t in step]
        at = 0
        for step in steps:
            for j in range(len(step) - 1):  # not the step's last token
                cut = at + j + 1
                before, upto = tok.decode(tokens[: cut - 1]), tok.decode(tokens[:cut])
                # The shortest end of the text that first appears with this token.
                stop = next(
                    (upto[-n:] for n in range(1, len(upto) + 1) if upto[-n:] not in before), ""
                )
                if not stop.strip() or len(stop) > 64:
                    continue
                params = SamplingParams(
                    max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop]
                )
                [want] = plain.generate([prompt], params)
                before_stats = dataclasses.replace(spec.engine.spec_stats())
                [got] = spec.generate([prompt], params)
                stats = spec.engine.spec_stats()
                # The step that completed the stop had verified tokens past it: cut.
                accepted = stats.accepted_tokens - before_stats.accepted_tokens
                rows = stats.verify_rows - before_stats.verify_rows
                assert stats.emitted_tokens - before_stats.emitted_tokens < accepted + rows
                assert (got.token_ids, got.text, got.finish_reason) == (
                    want.token_ids,
                    want.text,
                    want.finish_reason,
                )
                assert got.finish_reason == "stop" and len(got.token_ids) == cut
                assert stop not in got.text
                tried += 1
                if tried >= 3:
                    spec.engine.block_pool.check_no_leaks()
                    return
            at += len(step)
    pytest.fail(f"only {tried} stop strings landed inside an accepted run")


def test_stop_token_and_every_max_tokens(
    checkpoint: tuple[Path, list[list[int]]],
) -> None:
    model_dir, expected = checkpoint
    llm = LLM(model_dir, dtype="float32", speculative="ngram:k=5,adaptive=off")
    steps = _multi_token_steps(llm.engine, make_prompts()[0])
    tokens = [t for step in steps for t in step]
    assert tokens == expected[0]
    for n in range(1, len(tokens) + 1):  # every length, some ending inside a run
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        [out] = llm.generate([make_prompts()[0]], params)
        assert out.token_ids == tokens[:n] and out.finish_reason == "length"
    # A stop token (random models' accepted runs copy earlier output tokens, so it
    # first occurs before them; test_a_stop_inside_the_accepted_tokens_drops_the_rest
    # stops inside a run).
    stop_id = max(tokens, key=tokens.count)
    first = tokens.index(stop_id)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]
    )
    [out] = llm.generate([make_prompts()[0]], params)
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop"
    llm.engine.block_pool.check_no_leaks()


def test_context_limit_inside_an_accepted_run(checkpoint: tuple[Path, list[list[int]]]) -> None:
    model_dir, expected = checkpoint
    prompt = make_prompts()[0]  # 36 tokens
    for max_len in (39, 45, 52):
        llm = LLM(
            model_dir, dtype="float32", max_model_len=max_len, speculative="ngram:k=5,adaptive=off"
        )
        [out] = llm.generate([prompt], GREEDY)
        assert out.token_ids == expected[0][: max_len - len(prompt)]
        assert out.finish_reason == "length"
        llm.engine.block_pool.check_no_leaks()


def test_logprobs_are_the_targets(checkpoint: tuple[Path, list[list[int]]]) -> None:
    model_dir, _ = checkpoint
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    spec = LLM(model_dir, dtype="float32", speculative="ngram:k=4,adaptive=off")
    plain = LLM(model_dir, dtype="float32")
    prompts = make_prompts()[:4]
    wanted = plain.generate(prompts, params)
    for got, want in zip(spec.generate(prompts, params), wanted, strict=True):
        assert got.token_ids == want.token_ids
        assert got.logprobs is not None and want.logprobs is not None
        assert len(got.logprobs) == len(got.token_ids)
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert spec.engine.spec_stats().accepted_tokens > 0


# -- sampled requests ------------------------------------------------------------------


SAMPLED = [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=20, seed=2, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.6, top_p=0.9, seed=3, ignore_eos=True),
]


def test_seeded_sampling_gives_the_tokens_of_decoding_without_speculation(
    checkpoint: tuple[Path, list[list[int]]],
) -> None:
    """Verify rows draw with decoding's own (seed, position) numbers: a seeded request
    gets the same tokens with and without speculation, and again on a second run."""
    model_dir, _ = checkpoint
    prompts = make_prompts()[:4] * 3
    params = [SAMPLED[i % 3] for i in range(len(prompts))]
    plain = LLM(model_dir, dtype="float32").generate(prompts, params)
    spec = LLM(model_dir, dtype="float32", speculative="ngram:k=4,adaptive=off")
    first = spec.generate(prompts, params)
    second = spec.generate(prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in plain]
    assert [o.token_ids for o in second] == [o.token_ids for o in plain]
    stats = spec.engine.spec_stats()
    assert 0 < stats.accepted_tokens < stats.proposed_tokens
    check_pool(spec.engine, first + second)


def test_unseeded_sampling_runs_and_accepts(checkpoint: tuple[Path, list[list[int]]]) -> None:
    model_dir, _ = checkpoint
    spec = LLM(model_dir, dtype="float32", speculative="ngram:k=4,adaptive=off")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.3, ignore_eos=True)
    outs = spec.generate(make_prompts(), params)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    assert spec.engine.spec_stats().accepted_tokens > 0
    check_pool(spec.engine, outs)


def _chi_square_p(observed: dict[Any, int], expected: dict[Any, float], total: int) -> float:
    """Pearson's chi-square p-value of `observed` counts against `expected` probabilities
    (every category with a positive probability; none observed outside them)."""
    assert set(observed) <= set(expected), set(observed) - set(expected)
    stat = sum(
        (observed.get(c, 0) - total * p) ** 2 / (total * p) for c, p in expected.items() if p > 0
    )
    df = sum(p > 0 for p in expected.values()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def _target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from: tempered, then top-k, then top-p."""
    probs = (logits / params.temperature).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (0 < params.top_k <= rank) or mass >= params.top_p:
            break
        keep[i] = True
        mass += float(probs[i])
    probs = probs * keep
    return probs / probs.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, seed=0),  # seed is replaced per trial below
    ],
    ids=["plain", "temp-topk", "temp-topp", "seeded"],
)
def test_rejection_sampling_emits_the_target_distribution(params: SamplingParams) -> None:
    """Verify rows of two proposals over a 6-token vocabulary: the emitted sequences
    (rejected at the first proposal, at the second, or both accepted and a bonus token)
    must have the probabilities decoding without speculation gives them. Each trial is
    its own sequence (seeded trials: seed = trial), all verified in one sampling call,
    through the runner's own sampling of a step (`sample_step`)."""
    trials = 12000
    gen = torch.Generator().manual_seed(1)
    row_logits = torch.randn(3, 6, generator=gen) * 1.5  # positions 0, 1 and the bonus
    p0, p1, p2 = (_target(row_logits[j], params) for j in range(3))
    # Proposals the target takes now and then: p0's second most likely token, p1's first.
    proposals = (int(p0.argsort(descending=True)[1]), int(p1.argmax()))
    items, logits = [], []
    for trial in range(trials):
        p = params
        if params.seed is not None:
            p = SamplingParams(temperature=params.temperature, seed=trial)
        seq = Sequence(f"t{trial}", [1, 2, 3], p, frozenset(), NS)
        items.append(ScheduledSeq(seq, 3, 2, proposals))
        logits.append(row_logits)
    result = sample_step(Sampler(0, torch.device("cpu")), torch.cat(logits), items)
    observed: dict[tuple[int, ...], int] = {}
    for tokens in result.sampled.values():
        observed[tuple(tokens)] = observed.get(tuple(tokens), 0) + 1
    x0, x1 = proposals
    expected: dict[tuple[int, ...], float] = {}
    for y in range(6):
        expected[(y,)] = float(p0[y]) if y != x0 else 0.0
        expected[(x0, y)] = float(p0[x0] * p1[y]) if y != x1 else 0.0
        expected[(x0, x1, y)] = float(p0[x0] * p1[x1] * p2[y])
    assert abs(sum(expected.values()) - 1) < 1e-5
    assert p0[x0] > 0.05 and p1[x1] > 0.05, (p0, p1)
    p_value = _chi_square_p(observed, expected, trials)
    assert p_value > 1e-3, (p_value, observed, expected)
    # The acceptance rate of the first proposal is its target probability.
    accepted = sum(c for seq, c in observed.items() if len(seq) > 1) / trials
    assert abs(accepted - float(p0[x0])) < 4 * (float(p0[x0]) * (1 - float(p0[x0])) / trials) ** 0.5


# -- gauges ----------------------------------------------------------------------------


def test_load_reports_spec_gauges_only_with_speculation(
    checkpoint: tuple[Path, list[list[int]]],
) -> None:
    model_dir, _ = checkpoint
    plain = LLM(model_dir, dtype="float32")
    assert not any(key.startswith("spec_") for key in plain.engine.load())
    spec = LLM(model_dir, dtype="float32", speculative="ngram:k=2,adaptive=off")
    spec.generate(make_prompts()[:2], GREEDY)
    load = spec.engine.load()
    stats = spec.engine.spec_stats()
    assert load["spec_proposed_tokens"] == stats.proposed_tokens > 0
    assert load["spec_accepted_tokens"] == stats.accepted_tokens > 0
    assert load["spec_emitted_tokens"] == stats.emitted_tokens
    assert load["spec_verify_steps"] == stats.verify_steps > 0
    assert load["spec_verify_rows"] == stats.verify_rows >= stats.verify_steps
