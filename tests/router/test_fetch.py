"""Peer fetch, the router's decision (router/fetch.py) and its place in colocated
routing (router/core.py, `_route_colocated`). Plain Python over a stand-in index; the
cluster test (tests/decode_worker/test_peer_fetch.py) runs it on real workers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.prefix_index import MatchResult, WorkerInfo
from pdserve.common.sampling_params import SamplingParams
from pdserve.router.core import RouterCore
from pdserve.router.fetch import choose_fetch
from pdserve.router.metrics import FETCH_OUTCOMES
from tests.router.fakes import eventually, in_loop, output
from tests.router.test_core import PROMPT, Cluster, drain, take, tokens

BLOCK = 16


def matches(**blocks: int) -> dict[str, MatchResult]:
    return {
        w: MatchResult(WorkerInfo(w, "decode", f"addr-{w}", 1, {}), n) for w, n in blocks.items()
    }


def test_the_worker_holding_most_beyond_the_chosen_one_pushes_it() -> None:
    fetch = choose_fetch("a", matches(a=2, b=10, c=7), 200, BLOCK, 4, 1000.0, None)
    assert fetch is not None
    assert (fetch.holder, fetch.first_block, fetch.num_blocks) == ("b", 2, 10)
    assert fetch.compute_s == pytest.approx(8 * BLOCK / 1000.0)
    assert fetch.fetch_s is None  # not measured yet: fetched, and so measured


def test_a_fetch_stops_short_of_the_prompts_last_token() -> None:
    # 161 tokens: a lookup may use 10 full blocks; 10 tokens on, 160 leave only 9
    assert choose_fetch("a", matches(a=0, b=10), 161, BLOCK, 4, None, None).num_blocks == 10  # type: ignore[union-attr]
    assert choose_fetch("a", matches(a=0, b=10), 160, BLOCK, 4, None, None).num_blocks == 9  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("blocks", "min_blocks", "rate", "per_block"),
    [
        ({"a": 2, "b": 5}, 4, 1000.0, None),  # 3 blocks: fewer than the minimum
        ({"a": 2, "b": 10}, 0, 1000.0, None),  # fetches off
        ({"a": 2}, 4, 1000.0, None),  # nobody else
        ({"a": 2, "b": 10}, 4, 1000.0, 0.016),  # a push of a block as slow as computing it
    ],
)
def test_no_fetch(
    blocks: dict[str, int], min_blocks: int, rate: float, per_block: float | None
) -> None:
    assert choose_fetch("a", matches(**blocks), 400, BLOCK, min_blocks, rate, per_block) is None


def test_a_measured_push_sooner_than_computing_is_fetched() -> None:
    fetch = choose_fetch("a", matches(a=0, b=10), 400, BLOCK, 4, 1000.0, 0.001)
    assert fetch is not None and fetch.fetch_s == pytest.approx(0.010)


def test_a_holder_s_tiered_blocks_add_their_copies_to_the_push() -> None:
    """The holder has the 10 blocks the chosen worker lacks on disk (5 ms a block to read
    and copy out): a push of 1 ms a block then takes 60 ms, later than computing them
    (160 tokens at 4,000 tokens/s: 40 ms), so they are computed; at 1,000 tokens/s
    (160 ms) they are fetched, and the estimate counts the reads."""
    costs = {"kv_host_promote_us_per_block": 500, "kv_disk_read_us_per_block": 4_500}
    held = {
        "a": MatchResult(WorkerInfo("a", "decode", "addr-a", 1, {}), 0),
        "b": MatchResult(WorkerInfo("b", "decode", "addr-b", 1, costs), 10, 0, 10),
    }
    assert choose_fetch("a", held, 400, BLOCK, 4, 4000.0, 0.001) is None
    fetch = choose_fetch("a", held, 400, BLOCK, 4, 1000.0, 0.001)
    assert fetch is not None and fetch.fetch_s == pytest.approx(0.060)


class Index:
    def __init__(self, **blocks: int) -> None:
        self.blocks = blocks
        self.load = {"queued_prefill_tokens": 0}

    async def match(self, hashes: list[bytes]) -> dict[str, MatchResult]:
        return {
            w: MatchResult(WorkerInfo(w, "decode", f"addr-{w}", 1, dict(self.load)), n)
            for w, n in self.blocks.items()
        }


def _core(index: Index, **fields: Any) -> RouterCore:
    config = ClusterConfig(
        model="unused", mode="colocated", max_model_len=1024, block_size=BLOCK, **fields
    )
    return RouterCore(config, None, decode=object(), index=index)  # type: ignore[arg-type]


def test_routing_plans_the_fetch_and_reserves_only_what_is_computed() -> None:
    """Placement sends the prompt to the idle worker over the busy holder; the route
    names the holder, and the chosen worker's queue is charged the rest only."""
    index = Index(a=0, b=20)
    index.load = {"queued_prefill_tokens": 0}
    c = _core(index)
    prompt = list(range(3, 3 + 400))  # 24 full blocks a lookup may use
    c.load.decode_streams["b"] = 200  # the holder is busy
    route = asyncio.run(c.route(prompt, set(), False))
    assert route.placed.decode is not None and route.placed.decode.worker_id == "a"
    assert route.fetch is not None
    assert (route.fetch.holder, route.fetch.first_block, route.fetch.num_blocks) == ("b", 0, 20)
    assert c.inflight_local_tokens == {"a": 400 - 20 * BLOCK}
    route.release()
    c2 = _core(index, kv_fetch_min_blocks=0)
    c2.load.decode_streams["b"] = 200
    assert asyncio.run(c2.route(prompt, set(), False)).fetch is None


# -- the request path: RouterCore over fake decode replicas (tests/router/fakes.py) -------


def _fetching_cluster() -> Any:
    """Colocated; d1 holds the prompt's 6 full blocks but is busy, d0 is idle: placement
    chooses d0, which gets them from d1."""
    c = Cluster("d0", "d1", prefill_live=False, mode="colocated")
    c.index.add("d1", "decode", matched_blocks=6, running=200)
    return c


def _fetch_counts(c: Any) -> dict[str, float]:
    counts = {o: c.metric("pdserve_kv_fetch_total", outcome=o) for o in FETCH_OUTCOMES}
    return {o: n for o, n in counts.items() if n}


@in_loop
async def test_the_holder_pushes_to_the_chosen_workers_receiver_and_it_is_counted() -> None:
    """Two prompts with the same prefix, each placed on the idle worker: d1 pushes both
    times. The first push between the two also opened their connection: only the second
    is taken as the fetch rate."""
    c = _fetching_cluster()
    d0, d1 = c.decode["d0"], c.decode["d1"]
    first = output(11, num_prompt_tokens=len(PROMPT), num_cached_tokens=96, fetch="used",
                   fetched_blocks=6)  # fmt: skip
    d0.script["r1"] = [first, output(12, finished=True)]
    d0.script["r2"] = [first, output(12, finished=True)]
    try:
        for request_id, rate in (("r1", None), ("r2", 0.001)):
            items = await drain(
                c.core.generate(request_id, PROMPT, SamplingParams(max_tokens=2), 0.0)
            )
            assert tokens(items) == [11, 12]
            assert c.core.rates.fetch_s_per_block == (rate and pytest.approx(rate))
    finally:
        c.close()
    assert d0.submits["r1"]["fetch_blocks"] == 6
    push = {"fetch": "r1#fetch", "num_blocks": 6, "first_block": 0, "to": d0.address}
    assert d1.pushes == [push, {**push, "fetch": "r2#fetch"}]
    assert _fetch_counts(c) == {"used": 2}
    assert c.metric("pdserve_kv_fetch_blocks_total") == 12
    assert c.metric("pdserve_kv_fetch_bytes_total") == 12 * 4096
    assert d0.kv_cancelled == []
    c.assert_nothing_held()


def test_a_fetch_rate_stands_until_it_is_old_then_is_measured_again() -> None:
    from pdserve.router.disagg import FETCH_PROBE_S, RateBook

    rates = RateBook()
    rates.fetch_done("a", "b", seconds=1.0, blocks=10, now_s=100.0)  # the connection's
    assert rates.fetch_rate(100.0) is None
    rates.fetch_done("a", "b", seconds=0.5, blocks=10, now_s=101.0)
    assert rates.fetch_rate(101.0 + FETCH_PROBE_S) == pytest.approx(0.05)
    assert rates.fetch_rate(101.1 + FETCH_PROBE_S) is None  # stale: fetch to measure
    rates.forget_except(["a"])  # b is gone: a new b's first push opens a connection again
    rates.fetch_done("a", "b", seconds=9.0, blocks=10, now_s=200.0)
    assert rates.fetch_s_per_block == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (RuntimeError("ActorDiedError: the replica died"), "holder_failed"),
        (RuntimeError("NotHeldError: evicted"), "not_held"),
    ],
)
@in_loop
async def test_a_failed_push_frees_the_receiver_to_compute_at_once(
    error: BaseException, reason: str
) -> None:
    """The holder dies (or lost the blocks) mid-fetch: the router tells the receiver to
    stop waiting, with the reason, and the receiver's outcome is what gets counted."""
    c = _fetching_cluster()
    d0, d1 = c.decode["d0"], c.decode["d1"]
    d1.push_error = error
    d0.script["r1"] = [output(11, num_prompt_tokens=len(PROMPT), num_cached_tokens=0)]
    try:
        items = c.core.generate("r1", PROMPT, SamplingParams(max_tokens=2), 0.0)
        first = await take(items)
        await eventually("the receiver told", lambda: d0.kv_cancelled != [])
        # the receiver computed the prompt and reports the router's reason as its outcome
        d0.emit("r1", 12, finished=True, fetch=reason)
        rest = await drain(items)
    finally:
        c.close()
    assert tokens([first, *rest]) == [11, 12]
    assert d0.kv_cancelled == [("r1#fetch", reason)]
    assert c.core.rates.fetch_s_per_block is None  # a failure measures nothing
    assert c.metric("pdserve_kv_fetch_blocks_total") == 0
    c.assert_nothing_held()


@in_loop
async def test_a_prompt_left_to_the_decode_worker_fetches_from_a_prefill_worker() -> None:
    """Disaggregated: the router leaves a prompt to the decode worker (a short uncached
    part, the policy's choice); the prefill worker that prefilled its prefix before
    holds it, and pushes it to the decode worker instead of the decode worker computing
    it. No KV is expected from a prefill, and no prefill call is made."""
    c = Cluster("d0", local_prefill_max_tokens=200)
    d0 = c.decode["d0"]
    c.index.add("p0", "prefill", matched_blocks=6)
    d0.script["r1"] = [
        output(11, num_prompt_tokens=len(PROMPT), num_cached_tokens=96, fetch="used",
               fetched_blocks=6),
        output(12, finished=True),
    ]  # fmt: skip
    try:
        items = await drain(c.core.generate("r1", PROMPT, SamplingParams(max_tokens=2), 0.0))
    finally:
        c.close()
    assert tokens(items) == [11, 12]
    assert c.decisions("local", "short_prompt") == 1
    assert d0.submits["r1"]["kv_expected"] is False and d0.submits["r1"]["fetch_blocks"] == 6
    assert c.prefill.calls == []
    assert c.prefill.pushes == [{"fetch": "r1#fetch", "num_blocks": 6, "to": d0.address}]
    assert _fetch_counts(c) == {"used": 1}
    assert c.local_prefills() == {"policy": 1}
    c.assert_nothing_held()


@in_loop
async def test_a_prompt_sent_to_the_prefill_pool_fetches_its_prefix_from_the_holder() -> None:
    """Disaggregated, every prompt prefilled remotely: the decode worker holds the
    prompt's 6 full blocks (an earlier turn), the prefill worker none. The prefill
    worker would compute all of them to prefill the rest; instead it expects them
    (`expect_fetch`), the holder pushes them to its receiver, and its prefill call says
    how many it fetched. Its queue is charged only what it computes."""
    c = Cluster("d0", disagg_policy="always")
    d0 = c.decode["d0"]
    c.index.add("d0", "decode", matched_blocks=6)
    d0.script["r1"] = [output(11, kv_used=True), output(12, finished=True)]
    try:
        items = await drain(c.core.generate("r1", PROMPT, SamplingParams(max_tokens=2), 0.0))
    finally:
        c.close()
    assert tokens(items) == [11, 12]
    assert c.decisions("remote", "always") == 1
    assert c.prefill.fetches == {"r1": 6}
    push = {"fetch": "r1#fetch", "num_blocks": 6, "first_block": 0, "to": c.prefill.address}
    assert d0.pushes == [push]
    (call,) = c.prefill.calls
    assert (call["fetch_blocks"], call["first_block"]) == (6, 6)  # D holds them: not sent
    assert c.log.index(("expect_fetch", "p0", "r1")) < c.log.index(("prefill", "p0", "r1"))
    assert _fetch_counts(c) == {"used": 1}
    assert c.metric("pdserve_kv_fetch_blocks_total") == 6
    assert c.local_prefills() == {}
    c.assert_nothing_held()


@in_loop
async def test_a_failed_push_to_the_prefill_worker_frees_it_to_compute() -> None:
    """The holder's push to the prefill worker fails: the router tells the prefill
    worker to stop waiting (`cancel_kv` on the prefill pool), and the prefill worker's
    report says why; the request is served."""
    c = Cluster("d0", disagg_policy="always")
    d0 = c.decode["d0"]
    c.index.add("d0", "decode", matched_blocks=6)
    d0.push_error = RuntimeError("holder died")
    d0.script["r1"] = [output(11, kv_used=True), output(12, finished=True)]
    hold = asyncio.Event()
    c.prefill.hold = hold  # the prefill waits for its fetch while the push fails
    try:
        gen = c.core.generate("r1", PROMPT, SamplingParams(max_tokens=2), 0.0)
        first = asyncio.create_task(take(gen))
        await eventually(
            "the prefill worker told to stop waiting",
            lambda: c.prefill.fetch_cancels == [("r1#fetch", "holder_failed")],
        )
        hold.set()
        items = [await first, *(await drain(gen))]
    finally:
        c.close()
    assert tokens(items) == [11, 12]
    assert _fetch_counts(c) == {"holder_failed": 1}
    assert c.metric("pdserve_kv_fetch_blocks_total") == 0
    c.assert_nothing_held()
