"""A worker's side of the prefix index: register, heartbeat, publish KV events.

Each prefill or decode replica runs one `IndexMember`. It registers under a fresh
generation, renews the lease every `heartbeat_s` with the worker's load, and publishes
its block pool's STORED/REMOVED events, both on every tick and whenever the worker asks
(`flush`, after a request's blocks were cached, so the router sees them at once). When
the index says the registration is gone (lease expired during a stall, Redis restarted
or flushed) it registers again and republishes a snapshot of everything it holds. A
Redis outage is logged and retried on the next tick; the worker keeps serving.
Plain Python: the engine is reached only through the callables it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from pdserve.cluster.prefix_index import KVFormatMismatchError, PrefixIndex, WorkerInfo
from pdserve.common.kv_events import KVEvent

logger = logging.getLogger(__name__)

# The longest stop() waits for the heartbeat task beyond one heartbeat period.
STOP_GRACE_S = 5.0

LoadFn = Callable[[], Awaitable[dict[str, int]]]
EventsFn = Callable[[], Awaitable[list[KVEvent]]]
DrainFn = Callable[[], Awaitable[float | None]]


class LastKnownLoad:
    """A `LoadFn` that answers within `wait_s` while the engine is inside a long step.

    A worker's load is read on its engine thread between two steps, and one step can
    outlast the index lease: a prefill worker with one core took a 2,048-token batch of
    the mid model in about 14 s, past the 10 s lease, so it left the index mid-step and
    the router, seeing no prefill worker, had decode workers prefill (reason
    `no_prefill_worker`, 16 of 48 prompts on `side_by_side.sh mid load` with a raised
    queue bound). So a read not answered within `wait_s` gives the load of the last
    answer (the queue as of the step's start; the router counts what it sent since),
    and the heartbeat renews the lease. Only while the step has run less than
    `stuck_s` (`busy_s()`: seconds the current step has run, 0 between steps): an engine
    stuck longer is waited for, the lease lapses and the router stops placing there, as
    it does for a dead worker. Only one read is outstanding at a time; its answer, when
    it comes, is the next last-known load.
    """

    def __init__(
        self, load: LoadFn, wait_s: float, busy_s: Callable[[], float], stuck_s: float
    ) -> None:
        self._load = load
        self.wait_s = wait_s
        self._busy_s = busy_s
        self.stuck_s = stuck_s
        self.last: dict[str, int] | None = None
        self.num_stale = 0  # answers given from the last-known load
        self._pending: asyncio.Future[dict[str, int]] | None = None

    async def __call__(self) -> dict[str, int]:
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._load())
            self._pending.add_done_callback(self._keep)
        pending = self._pending
        try:
            return await asyncio.wait_for(asyncio.shield(pending), self.wait_s)
        except TimeoutError:
            if self.last is not None and self._busy_s() < self.stuck_s:
                self.num_stale += 1
                return self.last
        return await pending

    def _keep(self, future: asyncio.Future[dict[str, int]]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.last = future.result()


class IndexMember:
    """Keeps one worker's registration and block entries in the index current.

    Args:
        index: The model's prefix index.
        worker_id: Stable id of this worker (its Ray Serve replica id).
        role: "prefill" or "decode".
        address: Where peers reach it (a decode worker's KV receiver), or "".
        load: Returns the load gauges sent with each heartbeat.
        drain_events: Returns the block pool's events since the last call.
        snapshot: Returns every cached block as STORED events (drops pending events).
        heartbeat_s: Seconds between heartbeats; well under the index's lease.
        kv_format: The format of this worker's KV blocks (KV cache dtype and block size);
            the index refuses it while a live worker has another (start() raises
            KVFormatMismatchError; a later re-registration logs it and retries each tick).
        drain_deadline: Read after each heartbeat: the worker's drain deadline once a
            router announced that it leaves its pool (cluster/drain.py), else None. Then
            the worker leaves the index for good and `on_drain(deadline)` is called.
    """

    def __init__(
        self,
        index: PrefixIndex,
        worker_id: str,
        role: str,
        address: str,
        load: LoadFn,
        drain_events: EventsFn,
        snapshot: EventsFn,
        heartbeat_s: float,
        kv_format: str = "",
        drain_deadline: DrainFn | None = None,
        on_drain: Callable[[float], None] | None = None,
    ) -> None:
        self.index = index
        self._drain_deadline = drain_deadline
        self._on_drain = on_drain
        self.draining_since: float | None = None  # set once the drain notice came
        self.kv_format = kv_format
        self.worker_id = worker_id
        self.role = role
        self.address = address
        self._load = load
        self._drain_events = drain_events
        self._snapshot = snapshot
        self.heartbeat_s = heartbeat_s
        self.generation: int | None = None
        self.num_registrations = 0
        self._lock = asyncio.Lock()  # events must reach Redis in the order they happened
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        """Register (retrying on the heartbeat period) and start the heartbeat task."""
        with contextlib.suppress(RedisError, OSError):
            await self._sync()
        self._task = asyncio.create_task(self._run(), name=f"index-member-{self.worker_id}")

    async def flush(self) -> None:
        """Publish pending events now; a Redis error is logged, not raised."""
        try:
            await self._sync(heartbeat=False)
        except (RedisError, OSError) as exc:
            logger.warning("prefix index unreachable (%s); will retry", exc)

    async def stop(self) -> None:
        """Stop heartbeats and remove this worker from the index (graceful shutdown)."""
        if self._task is not None:
            # NOTE: not only cancel(): a cancellation delivered during a heartbeat can be lost
            # in the awaited call chain (most likely redis-py's cleanup on cancellation, which
            # awaits a disconnect under its own timeout; the line was not pinned), and then
            # awaiting the task waited forever (seen in tests/cluster/test_index_member.py).
            # The flag ends the loop at its next turn whatever happened to the cancel, and
            # the wait is bounded either way: a shutdown never hangs on its heartbeat.
            self._stopping = True
            self._task.cancel()
            done, _ = await asyncio.wait({self._task}, timeout=self.heartbeat_s + STOP_GRACE_S)
            if not done:
                logger.warning("index heartbeat of %s did not stop; left behind", self.worker_id)
            elif not self._task.cancelled() and self._task.exception() is not None:
                logger.warning(
                    "index heartbeat of %s ended: %r", self.worker_id, self._task.exception()
                )
            self._task = None
        if self.generation is not None:
            with contextlib.suppress(RedisError, OSError):
                await asyncio.wait_for(
                    self.index.deregister(self.worker_id, self.generation), self.heartbeat_s
                )
            self.generation = None

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.heartbeat_s)
            if self._stopping:
                return
            try:
                await self._sync()
                if self._drain_deadline is not None:
                    deadline = await self._drain_deadline()
                    if deadline is not None:
                        await self._leave(deadline)
                        return
            except (RedisError, OSError) as exc:
                logger.warning("prefix index unreachable (%s); will retry", exc)
            except KVFormatMismatchError as exc:
                logger.error("not placed: %s", exc)

    async def _leave(self, deadline: float) -> None:
        """The drain notice came (cluster/drain.py): leave the index for good (no more
        heartbeats, its blocks' entries gone), then tell the replica."""
        self._stopping = True
        self.draining_since = time.monotonic()
        async with self._lock:
            if self.generation is not None:
                await self.index.deregister(self.worker_id, self.generation)
                self.generation = None
        logger.info("%s is leaving its pool: left the prefix index", self.worker_id)
        if self._on_drain is not None:
            self._on_drain(deadline)

    async def _sync(self, heartbeat: bool = True) -> None:
        if self.draining_since is not None:  # left for good: never registers again
            await self._drain_events()
            return
        # the load is read before taking the lock: a flush must not queue behind it
        load = await self._load() if heartbeat else None
        async with self._lock:
            if self.generation is None:
                await self._register()
                return
            events = await self._drain_events()
            alive = True
            try:
                if events:
                    alive = await self.index.publish(self.worker_id, self.generation, events)
                if alive and load is not None:
                    alive = await self.index.heartbeat(self.worker_id, self.generation, load)
            except (RedisError, OSError):
                # The drained events may be lost: register again with a snapshot.
                self.generation = None
                raise
            if not alive:
                logger.warning("index registration of %s lost; registering again", self.worker_id)
                await self._register()

    async def _register(self) -> None:
        load = await self._load()
        worker = WorkerInfo(
            self.worker_id, self.role, self.address, load=load, kv_format=self.kv_format
        )
        generation = await self.index.register(worker)
        # The snapshot is taken after registering: whatever is cached from now on is
        # either in it or in a later event, so nothing published is missed.
        events = await self._snapshot()
        if events and not await self.index.publish(self.worker_id, generation, events):
            return  # superseded already; the next tick registers again
        self.generation = generation
        self.num_registrations += 1
