"""The router's side of a scale-down (router/departures.py): each worker Serve's request
routers saw leave is announced once to its model's pool, with that pool's deadline."""

from __future__ import annotations

import asyncio

from redis.exceptions import ConnectionError as RedisConnectionError

from pdserve.cluster.settings import model_app_name
from pdserve.router.departures import announce_departures
from pdserve.router.request_router import Departures


class FakeNotices:
    def __init__(self, fail: int = 0) -> None:
        self.announced: dict[str, float] = {}
        self.fail = fail  # this many calls raise first

    async def announce(self, worker_id: str, deadline_in_s: float) -> bool:
        if self.fail:
            self.fail -= 1
            raise RedisConnectionError("down")
        first = worker_id not in self.announced
        self.announced.setdefault(worker_id, deadline_in_s)
        return first


class FakePool:
    def __init__(self, deadline_s: float, fail: int = 0) -> None:
        self.drain_notices = FakeNotices(fail)
        self.drain_deadline_s = deadline_s
        self.counted: list[str] = []

    def count_drain(self, role: str) -> None:
        self.counted.append(role)


def test_each_departure_is_announced_to_its_models_pool() -> None:
    a, b = FakePool(20.0), FakePool(5.0)
    departures = Departures()
    departures.note(model_app_name("a"), "Decode", {"d1", "d2"})
    departures.note(model_app_name("b"), "Prefill", {"p1"})
    departures.note(model_app_name("b"), "Router", {"r1"})  # no pool: nothing to drain
    departures.note("another-app", "Decode", {"x1"})
    n = asyncio.run(announce_departures({"a": a, "b": b}, departures, single=False))
    assert n == 3
    assert a.drain_notices.announced == {"d1": 20.0, "d2": 20.0} and a.counted == ["decode"] * 2
    assert b.drain_notices.announced == {"p1": 5.0} and b.counted == ["prefill"]
    assert departures.seen == {"d1", "d2", "p1", "r1", "x1"}  # placement skips them all
    # another router announced d1 already: not counted again here
    departures.note(model_app_name("a"), "Decode", {"d1"})
    assert asyncio.run(announce_departures({"a": a}, departures, single=False)) == 1
    assert a.counted == ["decode"] * 2


def test_one_model_whose_pools_share_the_routers_application() -> None:
    pool = FakePool(20.0)
    departures = Departures()
    departures.note("pdserve", "Decode", {"d1"})
    assert asyncio.run(announce_departures({"m": pool}, departures, single=True)) == 1
    assert pool.drain_notices.announced == {"d1": 20.0}


def test_a_departure_redis_did_not_take_is_announced_at_the_next_call() -> None:
    pool = FakePool(20.0, fail=1)
    departures = Departures()
    departures.note("pdserve", "Decode", {"d1"})
    assert asyncio.run(announce_departures({"m": pool}, departures)) == 0
    assert asyncio.run(announce_departures({"m": pool}, departures)) == 1
    assert pool.drain_notices.announced == {"d1": 20.0} and pool.counted == ["decode"]
