"""The planner's model (router/planner.py): counts that meet latency targets, moving
with the traffic; a budget, a forecast and a hold against flapping."""

from __future__ import annotations

import math

import pytest

from pdserve.router.planner import (
    Bounds,
    Hold,
    StepCost,
    Targets,
    Traffic,
    forecast_rate,
    plan,
    predict_decode,
    predict_prefill,
    queue_wait_s,
)

# a CPU worker of a small model: 5 ms a step, 0.5 ms a decode row, 0.25 ms a prompt token;
# TTFT 2 s and ITL 20 ms at p90, met within 80% of them
STEP = StepCost(fixed=0.005, per_row=0.0005, per_context=1e-7, per_prefill_token=0.00025)
TARGETS = Targets(ttft_s=2.0, itl_s=0.02, percentile=0.9, headroom=0.8)
BOUNDS = Bounds(1, 8)


def test_the_queue_wait_grows_with_utilization_and_has_no_bound_at_one() -> None:
    assert queue_wait_s(0.1, 0.05, 0.9) == 0.0  # below 1 - q: most never wait
    waits = [queue_wait_s(0.1, rho, 0.9) for rho in (0.2, 0.5, 0.8, 0.95)]
    assert all(w is not None for w in waits)
    assert waits == sorted(waits) and waits[0] < waits[-1]  # type: ignore[type-var]
    assert waits[1] == pytest.approx(0.1 / 0.5 * math.log(0.5 / 0.1))
    assert queue_wait_s(0.1, 1.0, 0.9) is None


def test_more_replicas_predict_lower_latency_and_too_few_cannot_keep_up() -> None:
    traffic = Traffic(rate=4.0, prompt_tokens=1024, output_tokens=64)
    prefill = [predict_prefill(traffic, STEP, STEP, n, 0.9) for n in (1, 2, 4)]
    assert prefill[0].ttft_s is None  # 4 x 0.26 s of work a second on one replica
    assert prefill[1].ttft_s is not None and prefill[2].ttft_s is not None
    assert prefill[2].ttft_s < prefill[1].ttft_s
    decode = [predict_decode(traffic, STEP, n, 0.9, colocated=False) for n in (1, 2, 4)]
    itls = [p.itl_s for p in decode]
    assert all(i is not None for i in itls) and itls == sorted(itls, reverse=True)  # type: ignore[type-var]


def test_the_counts_follow_the_rate() -> None:
    counts = []
    for rate in (0.5, 2.0, 4.0, 8.0):
        traffic = Traffic(rate=rate, prompt_tokens=1024, output_tokens=128)
        p = plan(traffic, TARGETS, STEP, STEP, BOUNDS, BOUNDS)
        assert p.prefill is not None
        counts.append((p.prefill, p.decode))
    assert counts == sorted(counts) and counts[0] < counts[-1], counts
    assert counts[0] == (1, 1)


def test_a_shift_from_long_prompts_to_long_outputs_moves_replicas_to_decode() -> None:
    long_prompts = Traffic(rate=3.0, prompt_tokens=2048, output_tokens=16)
    long_outputs = Traffic(rate=3.0, prompt_tokens=128, output_tokens=512)
    a = plan(long_prompts, TARGETS, STEP, STEP, BOUNDS, BOUNDS)
    b = plan(long_outputs, TARGETS, STEP, STEP, BOUNDS, BOUNDS)
    assert a.prefill is not None and b.prefill is not None
    assert b.prefill < a.prefill and b.decode > a.decode, (a, b)


def test_prompts_prefilled_on_decode_workers_weigh_on_the_decode_pool() -> None:
    remote = Traffic(rate=3.0, prompt_tokens=1024, output_tokens=256, local=0.0)
    half = Traffic(rate=3.0, prompt_tokens=1024, output_tokens=256, local=0.5)
    a = plan(remote, TARGETS, STEP, STEP, BOUNDS, BOUNDS)
    b = plan(half, TARGETS, STEP, STEP, BOUNDS, BOUNDS)
    assert b.decode > a.decode and b.prefill is not None and a.prefill is not None
    assert b.prefill <= a.prefill


def test_colocated_sizes_the_one_pool_for_both_targets() -> None:
    traffic = Traffic(rate=2.0, prompt_tokens=1024, output_tokens=64)
    p = plan(traffic, TARGETS, None, STEP, None, BOUNDS)
    assert p.prefill is None and "prefill" not in p.candidates
    chosen = next(c for c in p.candidates["decode"] if c.replicas == p.decode)
    assert chosen.ttft_s is not None and chosen.ttft_s <= 1.6  # within the headroom
    smaller = [c for c in p.candidates["decode"] if c.replicas < p.decode]
    assert all(
        c.ttft_s is None or c.ttft_s > 1.6 or c.itl_s is None or c.itl_s > 0.016 for c in smaller
    )


def test_a_budget_cuts_the_pool_that_suffers_least_and_keeps_minimums() -> None:
    traffic = Traffic(rate=8.0, prompt_tokens=1024, output_tokens=128)
    free = plan(traffic, TARGETS, STEP, STEP, BOUNDS, BOUNDS)
    assert free.prefill is not None and free.prefill + free.decode > 4
    cut = plan(traffic, TARGETS, STEP, STEP, BOUNDS, BOUNDS, budget=4)
    assert cut.budget_cut and cut.prefill is not None and cut.prefill + cut.decode == 4
    assert cut.prefill >= 1 and cut.decode >= 1
    tiny = plan(traffic, TARGETS, STEP, STEP, Bounds(2, 8), Bounds(2, 8), budget=3)
    assert (tiny.prefill, tiny.decode) == (2, 2)  # the minimums win over the budget


def test_kv_capacity_bounds_the_decode_pool() -> None:
    traffic = Traffic(rate=4.0, prompt_tokens=2048, output_tokens=256)
    loose = plan(traffic, TARGETS, STEP, STEP, BOUNDS, BOUNDS, kv_tokens_per_replica=1e9)
    tight = plan(traffic, TARGETS, STEP, STEP, BOUNDS, BOUNDS, kv_tokens_per_replica=5_000)
    assert tight.decode > loose.decode


def test_the_forecast_follows_a_rise_smooths_noise_and_does_not_anticipate_a_fall() -> None:
    rising = [(0.0, 1.0), (5.0, 2.0), (10.0, 3.0)]
    assert forecast_rate(rising, 10.0) == pytest.approx(5.0)
    falling = [(0.0, 3.0), (5.0, 2.0), (10.0, 1.0)]
    assert forecast_rate(falling, 10.0) == 2.0  # the last windows' mean: no lower
    noisy = [(0.0, 5.0), (2.0, 6.0), (4.0, 4.0), (6.0, 5.0)]  # flat, each window's noise
    assert forecast_rate(noisy, 10.0) == pytest.approx(5.0)
    assert forecast_rate([(0.0, 2.0)], 10.0) == 2.0 and forecast_rate([], 10.0) == 0.0


def test_the_hold_scales_up_at_once_and_down_after_its_window() -> None:
    hold = Hold(hold_s=30.0)
    assert hold.apply(0.0, 2) == 2
    assert hold.apply(5.0, 4) == 4  # up at once
    assert hold.apply(10.0, 1) == 4  # down: not yet
    assert hold.apply(30.0, 1) == 4
    assert hold.apply(36.0, 1) == 1  # every plan of the last 30 s wanted 1
