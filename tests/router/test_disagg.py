"""Conditional disaggregation, prefill admission and the rates they rest on (router/disagg.py).

Plain Python: the decision is a function of estimates, the estimates of measured rates
and queues; the cluster test (test_conditional_cluster.py) shows them on real workers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.prefix_index import MatchResult, WorkerInfo
from pdserve.cluster.rate_meter import RateMeter
from pdserve.router.core import Placed, Route
from pdserve.router.disagg import (
    REASONS,
    SPILL_WINDOW_S,
    Decision,
    Option,
    RateBook,
    SpillBudget,
    decide,
    kv_wait_s,
)
from pdserve.router.priority import prefill_queue_bound_s

RATE = 1000.0  # tokens per second, both sides unless a test says otherwise


def config(**fields: Any) -> ClusterConfig:
    return ClusterConfig(model="unused", **fields)


def remote(uncached: int = 512, queued: int = 0, rate: float | None = RATE) -> Option:
    return Option("p", uncached, queued, rate)


def local(uncached: int = 512, queued: int = 0, rate: float | None = RATE) -> Option:
    return Option("d", uncached, queued, rate)


def test_estimates_are_queue_plus_prompt_over_the_rate_plus_the_push() -> None:
    o = Option("p", uncached_tokens=500, queued_tokens=1500, tokens_per_s=1000.0, extra_s=0.25)
    assert o.queue_s == pytest.approx(1.5)
    assert o.seconds == pytest.approx(2.25)
    unmeasured = Option("p", 500, 1500, None)
    assert unmeasured.queue_s is None and unmeasured.seconds is None


def test_always_keeps_the_split_whatever_the_queues() -> None:
    d = decide(config(disagg_policy="always"), remote(queued=3000), local(uncached=8), 0)
    assert (d.where, d.reason) == ("remote", "always")
    assert d.estimate_s == pytest.approx(3.512)
    assert d.local_prefill_reason is None


def test_a_short_uncached_prompt_is_prefilled_on_the_decode_worker() -> None:
    cfg = config()  # local_prefill_max_tokens 32
    d = decide(cfg, remote(uncached=600), local(uncached=32), 0)
    assert (d.where, d.reason, d.local_prefill_reason) == ("local", "short_prompt", "policy")
    # uncached counts D's held prefix: a long prompt whose blocks D holds is short there
    assert decide(cfg, remote(uncached=600), local(uncached=20), 3).reason == "short_prompt"
    assert decide(cfg, remote(uncached=600), local(uncached=33), 0).where == "remote"
    # ... unless D's own queue makes it the slower place
    busy_decode = decide(cfg, remote(uncached=30), local(uncached=30, queued=5000), 0)
    assert (busy_decode.where, busy_decode.reason) == ("remote", "prefill_idle")


def test_an_idle_prefill_worker_takes_the_prompt_even_when_decode_is_as_fast() -> None:
    d = decide(config(), remote(queued=0), local(queued=0), 0)
    assert (d.where, d.reason) == ("remote", "prefill_idle")


def test_without_a_measured_rate_the_split_happens() -> None:
    d = decide(config(), remote(queued=4000, rate=None), local(rate=None), 0)
    assert (d.where, d.reason, d.estimate_s) == ("remote", "unmeasured", None)


def test_a_busy_decode_worker_never_prefills_a_long_prompt_because_it_is_sooner() -> None:
    # P: 1000 queued + 512 = 1.512 s; D: 0.512 s, yet one running stream would stall
    d = decide(config(), remote(queued=1000), local(), decode_running=1)
    assert (d.where, d.reason) == ("remote", "faster")
    # an idle D takes it: nobody stalls
    d = decide(config(), remote(queued=1000), local(), decode_running=0)
    assert (d.where, d.reason) == ("local", "faster")
    assert d.estimate_s == pytest.approx(0.512)


def test_the_decode_worker_prefills_when_it_finishes_sooner_interference_included() -> None:
    cfg = config(local_prefill_max_running=64, local_prefill_interference=0.05)
    # P: 1000 queued + 512 = 1.512 s; D: 0.512 s x (1 + 0.05 x 10) = 0.768 s
    d = decide(cfg, remote(queued=1000), local(), decode_running=10)
    assert (d.where, d.reason) == ("local", "faster")
    assert d.estimate_s == pytest.approx(0.512)
    # with 40 running sequences D's prefill counts 3x (1.536 s): P is sooner
    d = decide(cfg, remote(queued=1000), local(), decode_running=40)
    assert (d.where, d.reason) == ("remote", "faster")
    assert d.estimate_s == pytest.approx(1.512)
    # past the running bound, however fast
    cfg = config(local_prefill_max_running=8, local_prefill_interference=0.0)
    assert decide(cfg, remote(queued=1000), local(), decode_running=9).where == "remote"


def test_a_saturated_prefill_pool_hands_prompts_to_a_decode_worker_within_the_bound() -> None:
    cfg = config(local_prefill_interference=1.0, max_prefill_queue_s=4.0)
    # D is weighted 11x (0.512 x 11 = 5.6 s > P's 4.6 s) but P's queue is past 4 s
    d = decide(cfg, remote(queued=4100, uncached=512), local(), decode_running=10)
    assert (d.where, d.reason) == ("local", "prefill_saturated")


def test_a_busy_prefill_pool_spills_to_a_streaming_decode_worker_within_its_budget() -> None:
    cfg = config()  # local_prefill_max_running 0: D, streaming, is never "faster"
    # P: 1,000 tokens queued (1 s) + 0.512 s; D: 0.512 s, its own prefill within the room
    d = decide(cfg, remote(queued=1000), local(), decode_running=4, spill_room_s=0.6)
    assert (d.where, d.reason, d.local_prefill_reason) == ("local", "prefill_busy", "policy")
    assert d.estimate_s == pytest.approx(0.512)
    assert d.saved_s == pytest.approx(1.0)  # P's 1.512 s less D's 0.512 s
    # no room left in D's budget (or none given): the split
    d = decide(cfg, remote(queued=1000), local(), decode_running=4, spill_room_s=0.5)
    assert (d.where, d.reason, d.saved_s) == ("remote", "faster", 0.0)
    assert decide(cfg, remote(queued=1000), local(), decode_running=4).where == "remote"
    # P's queue shorter than the prompt's own time on D (0.4 s < 0.512 s): not worth D's time
    d = decide(cfg, remote(queued=400), local(), decode_running=4, spill_room_s=10.0)
    assert (d.where, d.reason) == ("remote", "faster")
    # D would not have it sooner (its own queue is longer than P's)
    d = decide(cfg, remote(queued=1000), local(queued=1200), 4, spill_room_s=10.0)
    assert (d.where, d.reason) == ("remote", "faster")
    # never onto D past the spill threshold, nor under "always"
    d = decide(cfg, remote(queued=9000), local(queued=4100), 4, spill_room_s=10.0)
    assert d.reason != "prefill_busy"
    always = config(disagg_policy="always")
    assert decide(always, remote(queued=1000), local(), 4, spill_room_s=10.0).where == "remote"


def test_the_spill_budget_refills_at_its_share_and_lets_a_full_bucket_take_any_prompt() -> None:
    budget = SpillBudget(share=0.1, burst_s=1.0)
    assert budget.room_s("d", now_s=0.0) == float("inf")  # a new worker: a full bucket
    budget.take("d", 0.6, now_s=0.0)
    assert budget.room_s("d", 0.0) == pytest.approx(0.4)
    assert budget.room_s("d", 2.0) == pytest.approx(0.6)  # + 0.1 s per second
    budget.take("d", 3.0, now_s=2.0)  # a long prompt runs the bucket into debt
    assert budget.room_s("d", 2.0) == 0.0
    assert budget.room_s("d", 26.0) == pytest.approx(0.0)  # -2.4 + 2.4: repaid, no more
    assert budget.room_s("d", 35.0) == pytest.approx(0.9)
    assert budget.room_s("d", 100.0) == float("inf")  # full again, and no fuller
    assert budget.room_s("other", 0.0) == float("inf")  # per worker
    budget.take("other", 1.0, 0.0)
    budget.forget_except(["d"])
    assert budget.room_s("other", 0.0) == float("inf")  # a worker gone and back: new
    # the cluster's share is split over the router replicas; 0 turns the rule off
    cfg = config(decode_prefill_share=0.3, router_replicas=3)
    split = SpillBudget.from_config(cfg)
    assert split.share == pytest.approx(0.1)
    assert split.burst_s == pytest.approx(0.1 * SPILL_WINDOW_S)
    assert SpillBudget.from_config(config(decode_prefill_share=0)).room_s("d", 0.0) == 0.0


def test_past_capacity_everywhere_the_request_is_shed() -> None:
    cfg = config(max_prefill_queue_s=4.0)
    d = decide(cfg, remote(queued=6000), local(queued=5000), 0)
    assert (d.where, d.reason) == ("shed", "over_capacity")
    assert d.retry_after_s == pytest.approx(1.0)  # the shortest queue's excess
    # always: only the prefill pool counts
    d = decide(config(disagg_policy="always"), remote(queued=4500), local(queued=0), 0)
    assert (d.where, d.retry_after_s) == ("shed", pytest.approx(0.5))
    # one option within the bound: served there
    assert decide(cfg, remote(queued=6000), local(queued=3000), 0).where == "local"


def test_a_lower_priority_is_shed_at_its_share_of_the_queue_bound() -> None:
    cfg = config(max_prefill_queue_s=4.0, priority_headroom=0.25)  # priority < 1: 3 s
    queues = (remote(queued=3500), local(queued=3200))  # 3.5 s and 3.2 s
    low = decide(cfg, *queues, 0, max_queue_s=prefill_queue_bound_s(cfg, 0))
    high = decide(cfg, *queues, 0, max_queue_s=prefill_queue_bound_s(cfg, 10))
    assert (low.where, low.retry_after_s) == ("shed", pytest.approx(0.2))
    assert high.where == "local"  # D, the shorter queue
    # past the whole bound both are shed; the default bound is the whole one
    full = (remote(queued=4500), local(queued=4200))
    assert decide(cfg, *full, 0, max_queue_s=prefill_queue_bound_s(cfg, 10)).where == "shed"
    assert decide(cfg, *queues, 0).where == "local"


def test_a_long_prompt_is_not_shed_by_an_idle_cluster() -> None:
    # 20 s of its own compute, nothing queued: only queues count against the bound
    cfg = config(max_prefill_queue_s=4.0, kv_wait_timeout_s=60.0)
    d = decide(cfg, remote(uncached=20_000), local(20_000), 0)
    assert (d.where, d.reason) == ("remote", "prefill_idle")
    # D waits 10 s at most (the default): its KV would be late, D prefills it from the start
    d = decide(config(max_prefill_queue_s=4.0), remote(uncached=20_000), local(20_000), 0)
    assert (d.where, d.reason, d.local_prefill_reason) == ("local", "kv_wait_limit", "policy")


def test_a_remote_prefill_longer_than_the_kv_wait_goes_to_the_decode_worker() -> None:
    cfg = config(
        max_prefill_queue_s=600.0,
        prefill_spill_queue_s=600.0,
        kv_wait_timeout_s=10.0,
        local_prefill_interference=1.0,
    )
    # P: 20 s queued + 0.5 s; D (10 streams, weighted 11x) would be slower, but D gives
    # up on KV after 10 s and prefills it then anyway
    d = decide(cfg, remote(queued=20_000), local(), decode_running=10)
    assert (d.where, d.reason) == ("local", "kv_wait_limit")
    assert d.estimate_s == pytest.approx(0.512)
    # within the wait: the split
    d = decide(cfg, remote(queued=9_000), local(), decode_running=10)
    assert (d.where, d.reason) == ("remote", "faster")
    # never onto a D past the shedding bound
    d = decide(cfg, remote(queued=20_000), local(queued=700_000), decode_running=10)
    assert (d.where, d.reason) == ("remote", "faster")


def test_the_spill_threshold_is_its_own_below_a_raised_shedding_bound() -> None:
    # an operator who queues instead of shedding (600 s) still has D help past 4 s of P
    cfg = config(max_prefill_queue_s=600.0, local_prefill_interference=1.0)
    assert cfg.prefill_spill_queue_s == 4.0
    d = decide(cfg, remote(queued=5_000), local(), decode_running=10)
    assert (d.where, d.reason) == ("local", "prefill_saturated")
    assert decide(cfg, remote(queued=3_000), local(), decode_running=10).where == "remote"
    # both past the threshold: whichever finishes the prompt sooner, the queues even out
    d = decide(cfg, remote(queued=10_000), local(queued=6_000), decode_running=10)
    assert (d.where, d.reason) == ("local", "prefill_saturated")
    d = decide(cfg, remote(queued=6_000), local(queued=10_000), decode_running=10)
    assert (d.where, d.reason) == ("remote", "faster")
    # P past the shedding bound, D not: D, however slow
    d = decide(cfg, remote(queued=601_000), local(queued=590_000), decode_running=10)
    assert (d.where, d.reason) == ("local", "prefill_saturated")
    # the threshold never exceeds the shedding bound
    low = config(max_prefill_queue_s=2.0, local_prefill_interference=1.0)
    d = decide(low, remote(queued=2_500), local(), decode_running=10)
    assert (d.where, d.reason) == ("local", "prefill_saturated")


def test_the_kv_wait_and_first_token_deadlines_follow_the_shedding_bound() -> None:
    default = config()
    assert (default.kv_wait_timeout_s, default.first_token_timeout_s) == (10.0, 120.0)
    # a request admitted at a 600 s bound waits 2 x 600 + 2 s for its KV
    raised = config(max_prefill_queue_s=600.0)
    assert (raised.kv_wait_timeout_s, raised.first_token_timeout_s) == (1202.0, 2404.0)
    assert kv_wait_s(raised, Decision("remote", "faster", 500.0)) == pytest.approx(1002.0)
    # what the operator sets is kept; the dump carries the derived values to the workers
    explicit = config(max_prefill_queue_s=600.0, kv_wait_timeout_s=30.0)
    assert (explicit.kv_wait_timeout_s, explicit.first_token_timeout_s) == (30.0, 120.0)
    again = ClusterConfig.model_validate(raised.model_dump())
    assert again.kv_wait_timeout_s == 1202.0


def test_unmeasured_queues_are_never_shed() -> None:
    d = decide(config(max_prefill_queue_s=0.001), remote(queued=10**6, rate=None), local(), 0)
    assert d.where == "remote"


def test_missing_options_keep_todays_behaviour() -> None:
    no_prefill = decide(config(), None, local(), 0)
    assert (no_prefill.where, no_prefill.local_prefill_reason) == ("local", "no_prefill_worker")
    unplaced = decide(config(), remote(), None, 0)
    assert (unplaced.where, unplaced.reason) == ("remote", "unplaced")


def test_every_decision_is_a_declared_reason() -> None:
    cfg = config()
    cases = [
        (remote(uncached=600), local(uncached=8), 0),
        (remote(queued=0), local(), 0),
        (remote(queued=100, rate=None), local(), 0),
        (remote(queued=5000), local(), 0),
        (remote(queued=600), local(), 0),
        (remote(queued=9000), local(queued=9000), 0),
    ]
    for r, lo, running in cases:
        d = decide(cfg, r, lo, running)
        assert d.reason in REASONS[d.where], d


def test_the_kv_wait_follows_the_estimate_under_the_maximum() -> None:
    cfg = config(kv_wait_factor=2.0, kv_wait_floor_s=1.0, kv_wait_timeout_s=10.0)
    assert kv_wait_s(cfg, Decision("remote", "faster", 2.0)) == pytest.approx(5.0)
    assert kv_wait_s(cfg, Decision("remote", "faster", 30.0)) == pytest.approx(10.0)
    assert kv_wait_s(cfg, Decision("remote", "unmeasured", None)) is None
    assert kv_wait_s(cfg, Decision("local", "faster", 2.0)) is None
    # a remote decision waits for the latest its prefill can be done: later prompts that
    # join its step add up to a whole step's budget (2048 tokens) to the work before it
    cfg = config(kv_wait_timeout_s=600.0, max_num_batched_tokens=2048)
    d = decide(cfg, remote(queued=512, uncached=512), local(), decode_running=1)
    assert (d.where, d.estimate_s) == ("remote", pytest.approx(1.024))
    assert d.latest_s == pytest.approx(2.56)  # (512 + 2048) / 1000
    assert kv_wait_s(cfg, d) == pytest.approx(2 * 2.56 + 2.0)
    # a prompt longer than a step: its own tokens
    d = decide(cfg, remote(queued=512, uncached=3000), local(3000), decode_running=1)
    assert d.latest_s == pytest.approx(3.512) and d.latest_s == d.estimate_s
    assert decide(cfg, remote(uncached=512), local(uncached=8), 0).latest_s is None  # local
    # the defaults: a request admitted at the bound still waits under the maximum
    d = config()
    at_bound = d.max_prefill_queue_s  # its queue; its own compute adds to it
    assert d.kv_wait_factor * at_bound + d.kv_wait_floor_s <= d.kv_wait_timeout_s


def test_the_rate_counts_busy_time_once_for_a_batch() -> None:
    meter = RateMeter(decay=0.5, min_tokens=64)
    assert meter.tokens_per_s is None
    # two 500-token prompts prefilled in the same second: 1000 tokens/s, not 500
    meter.add(500, 10.0, 11.0)
    meter.add(500, 10.0, 11.0)
    assert meter.tokens_per_s == pytest.approx(1000.0)
    fresh = RateMeter(decay=0.0, min_tokens=64)
    fresh.add(500, 10.0, 11.0)
    fresh.add(300, 10.5, 11.5)  # half of it overlaps the first: 0.5 s more busy
    assert fresh.tokens_per_s == pytest.approx(300 / 0.5)


def test_the_rate_ignores_tiny_prompts() -> None:
    meter = RateMeter(min_tokens=64)
    meter.add(1, 0.0, 0.01)  # `pdserve up`'s readiness probe: 100 tokens/s, meaningless
    assert meter.tokens_per_s is None
    meter.add(640, 1.0, 2.0)
    assert meter.tokens_per_s == pytest.approx(640.0)
    with pytest.raises(ValueError):
        RateMeter(decay=1.0)


def match(worker_id: str, role: str, **load: int) -> MatchResult:
    return MatchResult(WorkerInfo(worker_id, role, "", 1, load), 0)


def test_published_rates_win_and_unmeasured_workers_get_the_pools_mean() -> None:
    book = RateBook(decay=0.0)
    book.prefill_done("b", 800, compute_s=1.0, end_s=5.0)  # measured by this router only
    pool = {
        "a": match("a", "prefill", prefill_tokens_per_s=1200),
        "b": match("b", "prefill"),
        "c": match("c", "prefill"),
    }
    rates = book.prefill_rates(pool)
    assert rates == {"a": 1200.0, "b": pytest.approx(800.0), "c": pytest.approx(1000.0)}
    assert book.local_rate("d", pool_rate=1000.0) == 1000.0  # no local prefill seen yet
    book.local_done("d", 300, compute_s=0.5, end_s=9.0)
    assert book.local_rate("d", pool_rate=1000.0) == pytest.approx(600.0)
    book.forget_except(["a", "c"])
    assert "b" not in book.prefill and "d" not in book.local


def test_push_time_is_learned_per_block() -> None:
    book = RateBook(decay=0.5)
    assert book.push_s(10) == 0.0
    book.push_done(0.2, 10)
    book.push_done(0.4, 10)
    assert book.push_s(10) == pytest.approx(0.3)


def test_a_route_releases_what_it_reserved_exactly_once() -> None:
    queued: Counter[str] = Counter({"p": 100})
    route = Route(Placed(None, None, True), Decision("remote", "faster", 1.0), 3.0)
    route.hold("prefill", queued, "p", 512)
    assert queued["p"] == 612
    route.release("prefill")
    route.release("prefill")
    route.release()
    assert queued == Counter({"p": 100})
    route.hold("local", queued, "d", 0)  # nothing to compute: nothing reserved
    assert "d" not in queued
