"""A router replica's stop: what clients see while the cluster stops.

Serve stops a replica by waiting for its requests (streams included) to end, then calling
its `__del__`, and kills it at `graceful_shutdown_timeout_s`; nothing tells the replica
that the wait began, and a stream cut by the kill reaches its client as a broken
connection. So the router drains on its own, when either comes first: `pdserve up`'s
stop notice (cluster/stop_notice.py, published before anything is stopped), or Serve
deleting its application (`serve run`'s Ctrl-C, `serve shutdown`), polled here.
Draining, new requests get 503 (`shutting_down`, with `Retry-After`) and `/health` says
"stopping", so a load balancer sends them elsewhere; running streams go on for the
grace; those still running then end with an error event before `data: [DONE]`
(non-streamed ones with a 503). Once it holds no request, the router says so
(`on_drained`): `pdserve up` then stops the pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)

DELETING = "DELETING"
POLL_S = 1.0


async def serve_app_status(app_name: str) -> str | None:
    """The status Serve's controller gives application `app_name` (None: unknown)."""

    def read() -> str | None:
        from ray import serve

        app = serve.status().applications.get(app_name)
        if app is None:
            return None
        return str(getattr(app.status, "value", app.status))

    return await asyncio.to_thread(read)


class Drain:
    """Watches for the stop and runs it.

    Args:
        grace_s: How long running streams may go on once the stop began.
        on_expire: Ends every running stream (called once, when the grace is over).
        app_status: Returns the replica's application status ("DELETING" once stopping).
        inflight: How many requests the replica holds now.
        on_drained: Called once, when draining with none held (after `idle()` or at the
            start).
        notices: Runs until cancelled, calling its argument with the grace when the stop
            notice comes (cluster/stop_notice.py `listen`).
        poll_s: How often the status is read.
    """

    def __init__(
        self,
        grace_s: float,
        on_expire: Callable[[], None],
        app_status: Callable[[], Awaitable[str | None]],
        inflight: Callable[[], int] = lambda: 0,
        on_drained: Callable[[], None] = lambda: None,
        notices: Callable[[Callable[[float], None]], Coroutine[Any, Any, None]] | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self.grace_s = grace_s
        self._on_expire = on_expire
        self._app_status = app_status
        self._inflight = inflight
        self._on_drained = on_drained
        self._notices = notices
        self._poll_s = poll_s
        self.started_s: float | None = None
        self.expired = False
        self.drained = False
        self._tasks: list[asyncio.Task[None]] = []
        self._timer: asyncio.TimerHandle | None = None

    @property
    def draining(self) -> bool:
        return self.started_s is not None

    def watch(self) -> None:
        """Start watching (idempotent; needs a running event loop)."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._watch()))
        if self._notices is not None:
            self._tasks.append(loop.create_task(self._notices(self.begin)))

    async def _watch(self) -> None:
        while not self.draining:
            try:
                status = await self._app_status()
            except Exception as exc:  # the controller restarting: no verdict this round
                logger.debug("drain watch: no application status (%r)", exc)
                status = None
            if status == DELETING:
                self.begin()
                return
            await asyncio.sleep(self._poll_s)

    def begin(self, grace_s: float | None = None) -> None:
        """The stop began: refuse new requests, end the running ones after the grace."""
        if self.draining:
            return
        grace = self.grace_s if grace_s is None else grace_s
        self.started_s = time.monotonic()
        logger.warning("stopping: new requests get 503, running streams end within %g s", grace)
        self._timer = asyncio.get_running_loop().call_later(grace, self.expire)
        self.idle()

    def idle(self) -> None:
        """A request ended: report the drain done if draining and none is left."""
        if self.draining and not self.drained and self._inflight() == 0:
            self.drained = True
            self._on_drained()

    def expire(self) -> None:
        """End every running stream now (the grace is over, or the replica stops)."""
        if self.expired:
            return
        self.expired = True
        if self._timer is not None:
            self._timer.cancel()
        self._on_expire()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            self.expire()
