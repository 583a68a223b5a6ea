"""Prefill admission in colocated mode (router/core.py, `_route_colocated`).

Each decode worker prefills its own prompts there, so its queue of prompt tokens over
the rate this router measured of its prefills is the time a new prompt waits. Plain
Python: a RouterCore over a stand-in index whose answer each test sets; the cluster
test (test_colocated_shedding.py) shows the same on real workers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.prefix_index import MatchResult, WorkerInfo
from pdserve.router.core import Overloaded, Route, RouterCore

RATE = 1000.0  # tokens per busy second that the router measured, unless a test says
PROMPT = list(range(5, 105))  # 100 tokens, none cached anywhere


class Index:
    """The prefix index as placement sees it: every live worker, its load, no hits."""

    def __init__(self) -> None:
        self.workers: dict[str, dict[str, int]] = {}

    async def match(self, hashes: list[bytes]) -> dict[str, MatchResult]:
        return {
            w: MatchResult(WorkerInfo(w, "decode", f"addr-{w}", 1, dict(load)), 0)
            for w, load in self.workers.items()
        }


def core(index: Index, **fields: Any) -> RouterCore:
    config = ClusterConfig(model="unused", mode="colocated", max_model_len=512, **fields)
    return RouterCore(config, None, decode=object(), index=index)  # type: ignore[arg-type]


def measured(c: RouterCore, worker_id: str, rate: float = RATE) -> None:
    """As if the router had seen `worker_id` prefill at `rate` tokens per busy second."""
    c.rates.local_done(worker_id, int(rate), compute_s=1.0, end_s=100.0)


def route(c: RouterCore, resume: bool = False, priority: int = 0) -> Route:
    return asyncio.run(c.route(PROMPT, set(), resume, priority=priority))


def test_requests_are_admitted_until_their_own_reservations_pass_the_bound() -> None:
    index = Index()
    index.workers["d"] = {"queued_prefill_tokens": 0}  # the heartbeat has not seen them
    c = core(index)
    measured(c, "d")
    routes = []
    # each admitted prompt's 100 tokens count as queue until D reports it prefilled: the
    # 41st sees 4000 tokens (4 s at RATE, not past the 4 s bound), the 42nd 4100
    for _ in range(41):
        routes.append(route(c))
    assert all(r.placed.decode is not None and r.placed.decode.worker_id == "d" for r in routes)
    assert all(r.decision is None for r in routes)  # colocated: nothing decided or counted
    assert c.inflight_local_tokens == {"d": 41 * len(PROMPT)}
    with pytest.raises(Overloaded):
        route(c)
    assert c.inflight_local_tokens == {"d": 41 * len(PROMPT)}  # a refusal reserves nothing
    routes.pop().release()
    assert route(c).placed.decode is not None
    for r in routes:
        r.release()
    # a heartbeat that shows the queue counts as well, whichever is more
    index.workers["d"] = {"queued_prefill_tokens": 4100}
    with pytest.raises(Overloaded):
        route(c)


def test_past_the_bound_everywhere_the_request_is_shed_with_the_excess() -> None:
    index = Index()
    index.workers["d"] = {"queued_prefill_tokens": 6500}
    c = core(index)
    measured(c, "d")
    with pytest.raises(Overloaded, match="prefill capacity") as shed:
        route(c)
    assert shed.value.retry_after_s == 3  # 6.5 s queued - 4 s bound, rounded up
    assert not c.inflight_local_tokens  # nothing reserved for a refused request
    # a resumed stream's client already has tokens: it is never refused
    assert route(c, resume=True).placed.decode is not None


def test_an_over_queued_choice_gives_way_to_the_least_queued_worker() -> None:
    index = Index()
    # placement prefers "a" (no sequences running) although its prompt queue is long
    index.workers["a"] = {"queued_prefill_tokens": 9000}
    index.workers["b"] = {"queued_prefill_tokens": 1000, "running": 6}
    index.workers["c"] = {"queued_prefill_tokens": 2000, "running": 6}
    c = core(index)
    for w in ("a", "b"):
        measured(c, w)  # "c" is not measured: it gets the mean of the measured rates
    r = route(c)
    assert r.placed.decode is not None and r.placed.decode.worker_id == "b"
    assert r.placed.local is not None and r.placed.local.queue_s == pytest.approx(1.0)
    assert c.inflight_local_tokens == {"b": len(PROMPT)}


def test_unmeasured_workers_are_never_shed() -> None:
    index = Index()
    index.workers["d"] = {"queued_prefill_tokens": 10**6}
    c = core(index)  # no prefill seen yet: no rate, no estimate
    assert route(c).placed.decode is not None


def test_a_lower_priority_is_shed_at_its_share_of_the_bound() -> None:
    index = Index()
    index.workers["d"] = {"queued_prefill_tokens": 3000}  # 3 s: past 4 s x (1 - 0.5)
    c = core(index, priority_headroom=0.5, priority_reserved_min=1)
    measured(c, "d")
    with pytest.raises(Overloaded):
        route(c, priority=0)
    assert route(c, priority=1).placed.decode is not None
