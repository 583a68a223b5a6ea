"""Scheduler bookkeeping without a model: budgets, chunking, prefix reuse, preemption."""

from __future__ import annotations

import pytest

from pdserve.common.hashing import hash_namespace
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.sched.block_pool import BlockPool
from pdserve.engine.sched.kv_cache_manager import KVCacheManager
from pdserve.engine.sched.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from pdserve.engine.sched.sequence import Sequence, SequenceStatus

BLOCK = 4
NS = hash_namespace("test-model")


def make_scheduler(
    num_blocks: int = 16, budget: int = 64, max_seqs: int = 8, chunked: bool = True
) -> Scheduler:
    pool = BlockPool(num_blocks, enable_caching=True)
    limits = SchedulerLimits(max_seqs, budget, max_model_len=64, enable_chunked_prefill=chunked)
    return Scheduler(KVCacheManager(pool, BLOCK), limits)


def make_seq(rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, priority=priority)
    return Sequence(rid, prompt, params, eos_token_ids=frozenset({0}), hash_namespace=NS)


def planned(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, start, new tokens) of every scheduled sequence, in batch order."""
    return [(s.seq.request_id, s.start, s.num_new_tokens) for s in (*out.prefills, *out.decodes)]


def run_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {s.seq.request_id: token for s in (*out.prefills, *out.decodes) if s.samples}
    sched.update(out, sampled)
    return out


def test_budget_chunks_prompts_and_decodes_go_first() -> None:
    sched = make_scheduler(budget=12)
    a, b = make_seq("a", list(range(1, 11))), make_seq("b", list(range(20, 30)))
    sched.add(a)
    sched.add(b)
    assert planned(run_step(sched)) == [("a", 0, 10), ("b", 0, 2)]
    assert a.output_token_ids == [7] and b.output_token_ids == []
    # running first: b's next chunk, then a's decode token (decodes go last in the batch)
    assert planned(run_step(sched)) == [("b", 2, 8), ("a", 10, 1)]
    assert b.output_token_ids == [7]
    assert planned(run_step(sched)) == [("a", 11, 1), ("b", 10, 1)]
    assert sched.stats.num_chunked_prefill_steps == 1


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    sched = make_scheduler(budget=12, chunked=False)
    sched.add(make_seq("a", list(range(1, 11))))
    sched.add(make_seq("b", list(range(20, 30))))
    assert planned(run_step(sched)) == [("a", 0, 10)]
    assert planned(run_step(sched)) == [("b", 0, 10), ("a", 10, 1)]


def test_prefix_hit_skips_cached_blocks_and_leaves_one_token() -> None:
    sched = make_scheduler()
    prompt = list(range(1, 13))  # 3 full blocks
    first = make_seq("first", prompt, max_tokens=1)
    sched.add(first)
    run_step(sched)
    assert first.is_finished
    second, third = make_seq("second", prompt), make_seq("third", [*prompt[:8], 99, 98])
    sched.add(second)
    sched.add(third)
    # identical prompt: 2 of 3 blocks reused (the last token must be computed to sample)
    assert planned(sched.schedule()) == [("second", 8, 4), ("third", 8, 2)]
    assert second.num_cached_prompt_tokens == 8 and third.num_cached_prompt_tokens == 8
    assert [b.block_id for b in second.blocks[:2]] == [b.block_id for b in third.blocks[:2]]
    assert second.blocks[0].ref_count == 2


def test_preemption_frees_the_newest_and_recomputes_it_later() -> None:
    sched = make_scheduler(num_blocks=4, budget=64)
    a, b = make_seq("a", [1, 2, 3, 4, 5, 6], 8), make_seq("b", [9, 8, 7, 6, 5, 4], 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 blocks each, pool full
    assert sched.kv.pool.num_free_blocks == 0
    run_step(sched)  # positions 6 and 7 still fit in the second blocks
    run_step(sched)
    out = run_step(sched)  # a needs a third block for position 8: b (newest) is preempted
    assert [s.request_id for s in out.preempted] == ["b"]
    assert b.status is SequenceStatus.PREEMPTED and b.blocks == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == [7, 7, 7]
    assert planned(out) == [("a", 8, 1)]
    while not a.is_finished:
        run_step(sched)
    out = run_step(sched)
    # a's growth evicted b's freed blocks, so b recomputes prompt + its 3 outputs
    assert planned(out) == [("b", 0, 9)]
    assert b.num_preemptions == 1
    while sched.has_unfinished:
        run_step(sched)
    assert b.output_token_ids == [7] * 8
    sched.kv.pool.check_no_leaks()


def test_a_later_more_important_request_is_admitted_first() -> None:
    # larger priority is more important (vLLM's is the opposite); equals keep FIFO
    sched = make_scheduler(max_seqs=2)
    for rid, priority in [("low0", 0), ("low1", 0), ("neg", -5), ("high", 10), ("mid", 3)]:
        sched.add(make_seq(rid, [1, 2, 3], priority=priority))
    assert [s.request_id for s in sched.waiting] == ["high", "mid", "low0", "low1", "neg"]
    assert [rid for rid, _, _ in planned(run_step(sched))] == ["high", "mid"]
    assert [s.request_id for s in sched.waiting] == ["low0", "low1", "neg"]


def test_equal_priorities_keep_arrival_order() -> None:
    sched = make_scheduler(max_seqs=3)
    for i in range(5):
        sched.add(make_seq(f"s{i}", [i + 1, i + 2], priority=7))
    assert [rid for rid, _, _ in planned(run_step(sched))] == ["s0", "s1", "s2"]


def test_preemption_takes_the_least_important_sequence() -> None:
    # the same squeeze as the newest-first test, but the newest is the important one:
    # the older, low-priority sequence is preempted, and waits behind the important one
    sched = make_scheduler(num_blocks=4, budget=64)
    low = make_seq("low", [1, 2, 3, 4, 5, 6], 8, priority=0)
    high = make_seq("high", [9, 8, 7, 6, 5, 4], 8, priority=10)
    sched.add(low)
    sched.add(high)  # arrived later, admitted first
    out = run_step(sched)
    assert [s.seq.request_id for s in out.prefills] == ["high", "low"]
    run_step(sched)
    run_step(sched)
    out = run_step(sched)  # high needs a third block: low goes, although admitted first
    assert [s.request_id for s in out.preempted] == ["low"]
    assert low.status is SequenceStatus.PREEMPTED and high.status is SequenceStatus.RUNNING
    assert planned(out) == [("high", 8, 1)]
    later = make_seq("later", [5, 5, 5], 2, priority=0)
    sched.add(later)  # same priority as the preempted one: it queues behind it
    assert [s.request_id for s in sched.waiting] == ["low", "later"]
    while sched.has_unfinished:
        run_step(sched)
    assert high.num_preemptions == 0 and low.num_preemptions == 1
    assert low.output_token_ids == [7] * 8  # recomputed, same tokens
    sched.kv.pool.check_no_leaks()


def test_a_preempted_sequence_waits_behind_more_important_ones() -> None:
    sched = make_scheduler(num_blocks=4, budget=64)
    a, b = make_seq("a", [1, 2, 3, 4, 5, 6], 8, 5), make_seq("b", [9, 8, 7, 6, 5, 4], 8, 5)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        run_step(sched)
    sched.add(make_seq("urgent", [3, 3], 1, priority=9))
    sched.add(make_seq("minor", [4, 4], 1, priority=1))
    out = run_step(sched)  # a needs a block: b (newest of the equals) is preempted
    assert [s.request_id for s in out.preempted] == ["b"]
    assert [s.request_id for s in sched.waiting] == ["urgent", "b", "minor"]


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = make_scheduler(max_seqs=2)
    for i in range(3):
        sched.add(make_seq(f"s{i}", [i + 1, i + 2, i + 3]))
    assert [rid for rid, _, _ in planned(run_step(sched))] == ["s0", "s1"]
    assert len(sched.waiting) == 1


def test_stop_conditions() -> None:
    sched = make_scheduler()
    eos = make_seq("eos", [1, 2, 3])
    sched.add(eos)
    run_step(sched, token=0)  # 0 is this test's eos id
    assert eos.is_finished and eos.finish_reason is not None
    assert eos.finish_reason.value == "stop" and eos.output_token_ids == [0]
    length = make_seq("length", [1, 2, 3], max_tokens=2)
    sched.add(length)
    run_step(sched)
    run_step(sched)
    assert length.finish_reason is not None and length.finish_reason.value == "length"
    sched.kv.pool.check_no_leaks()


def test_abort_frees_blocks_in_any_state() -> None:
    sched = make_scheduler(budget=4)
    running, waiting = make_seq("r", list(range(1, 9))), make_seq("w", list(range(1, 9)))
    sched.add(running)
    sched.add(waiting)
    sched.schedule()
    assert running.blocks and not waiting.blocks
    aborted = sched.abort(["r", "w", "unknown"])
    assert {s.request_id for s in aborted} == {"r", "w"}
    assert not sched.has_unfinished
    assert all(s.finish_reason is not None and s.finish_reason.value == "abort" for s in aborted)
    sched.kv.pool.check_no_leaks()


@pytest.mark.parametrize("budget", [1, 3, 5])
def test_tiny_budgets_always_make_progress(budget: int) -> None:
    sched = make_scheduler(budget=budget)
    for i in range(3):
        sched.add(make_seq(f"s{i}", list(range(1, 8 + i)), max_tokens=3))
    for _ in range(200):
        if not sched.has_unfinished:
            break
        out = run_step(sched)
        assert 0 < out.num_tokens <= budget
    assert not sched.has_unfinished
    sched.kv.pool.check_no_leaks()
