"""router/draining.py: the router's stop starts when Serve deletes its application, and
its streams end once, `grace_s` later (tests/faults/test_stop_states.py runs it in a
cluster)."""

from __future__ import annotations

import asyncio

from pdserve.router.draining import Drain

TIMEOUT_S = 10.0


def test_the_drain_begins_when_the_application_is_deleted_and_ends_streams_once() -> None:
    async def body() -> None:
        statuses = iter(["DEPLOYING", "RUNNING", None, "DELETING"])
        asked = asyncio.Event()
        expired = asyncio.Event()
        calls: list[float] = []

        async def app_status() -> str | None:
            status = next(statuses)
            if status is None:
                raise ConnectionError("the controller restarts")  # no verdict this round
            if status == "DELETING":
                asked.set()
            return status

        def on_expire() -> None:
            calls.append(asyncio.get_running_loop().time())
            expired.set()

        drain = Drain(grace_s=0.2, on_expire=on_expire, app_status=app_status, poll_s=0.01)
        drain.watch()
        drain.watch()  # idempotent
        async with asyncio.timeout(TIMEOUT_S):
            await asked.wait()
            assert drain.draining and not drain.expired
            began = asyncio.get_running_loop().time()
            await expired.wait()
        assert calls[0] - began >= 0.15, "streams keep their grace"
        drain.close()  # the replica stops: already expired, nothing more
        assert len(calls) == 1

    asyncio.run(body())


def test_a_replica_stopped_before_its_grace_ends_its_streams_then() -> None:
    async def body() -> None:
        calls: list[str] = []

        async def app_status() -> str | None:
            return "RUNNING"

        drain = Drain(grace_s=60.0, on_expire=lambda: calls.append("end"), app_status=app_status)
        drain.begin()
        assert drain.draining and calls == []
        drain.close()
        assert calls == ["end"] and drain.expired

    asyncio.run(body())
