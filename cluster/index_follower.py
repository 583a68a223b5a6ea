"""A router's prefix index in its own memory, kept current from the workers' events.

`PrefixIndex.match` is a Lua script whose work grows with the live workers, run for every
request. A follower instead holds the index's block entries in an `IndexView`, so a match
walks only the prompt's chain (docs/prefix-index.md, "The in-memory view"):

- **Snapshot.** It notes the events stream's position (sequence number and entry id, one
  atomic read), reads the live workers and the `held:` set of each, and builds a view.
  Events written meanwhile are replayed from the noted position; set operations applied
  in order are idempotent, so one seen twice does no harm.
- **Events.** It reads the stream from its last entry id (`XREAD BLOCK`): a publish's
  ops, a registration (the worker's older generations leave the view), a deregistration.
  Each entry carries the next sequence number; one that is not the last plus one means
  entries were missed (trimmed while the router was behind or cut off, or Redis was
  restarted), and it takes a new snapshot, counted by reason.
- **Live workers.** It reads them with their load and the time left on their leases once
  per `refresh_s` (and at once after a registration): a worker whose lease lapses leaves
  the view's matches when its lease ends, not at the next read. The same read checks the
  index's epoch, which a restarted Redis no longer has.
- **Without Redis.** Matches go on from the last view while the last live read is no
  older than a lease (counted as `stale`); past that, `match` asks Redis, which fails, and
  the router places without the index as before. Until the first snapshot, matches are
  the Lua script's (counted as `redis`).

A stale view costs at most a worse placement: the decode worker's receiver checks every
block it is sent against the full hashes and the model. Plain Python: no torch.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from typing import Any

from redis.exceptions import RedisError

from pdserve.cluster.index_view import IndexView, hex_key
from pdserve.cluster.prefix_index import (
    MatchResult,
    PrefixIndex,
    StreamEvent,
    WorkerInfo,
    split_member,
)
from pdserve.common.hashing import BlockHash

logger = logging.getLogger(__name__)

SNAPSHOT_REASONS = ("start", "gap", "restart", "error")
# The router's shortlist per pool (`shortlist`): every worker of a pool this size or
# smaller, so placement there is exactly as over the whole pool; above it, a placement's
# cost stops growing with the fleet.
PLACEMENT_SHORTLIST = 16
MATCH_SOURCES = ("memory", "stale", "redis")
_SNAPSHOT_BATCH = 64  # registrations whose held sets are read in one pipeline
_MAX_BACKOFF_S = 2.0
_MAX_BLOCK_MS = 1000  # under the router client's socket timeout
_CLOSE_SLACK_S = 3.0


class IndexFollower:
    """One model's prefix index, matched in this process's memory.

    Args:
        index: The Redis index it follows (its `stream_len` is the workers').
        refresh_s: How often the live workers are read (the workers' heartbeat period).
        on_snapshot, on_match, on_lag: Hooks for metrics: a snapshot's reason, a match's
            source (`MATCH_SOURCES`), an event's lag in seconds.
        clock: Monotonic seconds (tests may pass their own).
        shortlist: None: a match answers for every live worker, as `PrefixIndex.match`
            does. A number K: per pool, only the K holders of the longest prefixes (the
            least loaded first among equals) and the K least loaded workers, as of the
            last live read; placement scores those (`router/core.py`), so its work grows
            with K, the chain and its holders, not with the fleet. The answer's `live`
            attribute holds every live worker's id.
    """

    def __init__(
        self,
        index: PrefixIndex,
        refresh_s: float,
        on_snapshot: Callable[[str], None] | None = None,
        on_match: Callable[[str], None] | None = None,
        on_lag: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        shortlist: int | None = None,
    ) -> None:
        self.index = index
        self.refresh_s = refresh_s
        self.lease_s = index.lease_ms / 1000
        self._on_snapshot = on_snapshot
        self._on_match = on_match
        self._on_lag = on_lag
        self._clock = clock
        self.view: IndexView | None = None
        self.shortlist = shortlist
        self.live: dict[str, tuple[WorkerInfo, float]] = {}  # id -> (info, lease end)
        # per pool, as of the last live read: worker ids by load, least first; the live
        # registrations' slots in the view; each slot's place in that order
        self._order: dict[str, list[str]] = {}
        self._order_slots: dict[str, list[int]] = {}
        self._pool_slots: dict[str, set[int]] = {}
        self._slot_rank: dict[str, dict[int, int]] = {}
        self.live_read_at = float("-inf")
        self.applied_seq = 0
        self.last_id = "0-0"
        self.epoch: str | None = None
        self.connected = False
        self.snapshots: Counter[str] = Counter()
        self.matches: Counter[str] = Counter()
        self.lags_s: deque[float] = deque(maxlen=10_000)
        self._resnapshot: str | None = "start"
        self._closing = False
        self._refresh_now = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Condition()

    # -- the request path ------------------------------------------------------------

    async def match(
        self, block_hashes: Sequence[BlockHash], role: str | None = None
    ) -> dict[str, MatchResult]:
        """`PrefixIndex.match`'s answer, from memory when the view can give it.

        Raises what `PrefixIndex.match` raises when it falls back to Redis.
        """
        self._ensure_started()
        now = self._clock()
        view = self.view
        if view is None or now - self.live_read_at > self.lease_s:
            self._count_match("redis")
            return await self.index.match(block_hashes, role)
        current = self.connected and self._resnapshot is None
        self._count_match("memory" if current else "stale")
        if self.shortlist is not None:
            return self._shortlisted(view, block_hashes, now, role)
        live = {
            worker_id: info
            for worker_id, (info, lease_end) in self.live.items()
            if lease_end > now and (role is None or info.role == role)
        }
        counts = view.match(block_hashes, {w: info.generation for w, info in live.items()})
        return {w: _result(view, block_hashes, live[w], counts[w]) for w in sorted(live)}

    def _shortlisted(
        self, view: IndexView, block_hashes: Sequence[BlockHash], now: float, role: str | None
    ) -> Shortlist:
        """Per pool, the `shortlist` longest holders (least loaded first among equals)
        and the `shortlist` least loaded workers; their entries' registrations must be
        the live ones."""
        assert self.shortlist is not None
        levels: Levels = view.levels(block_hashes)
        k = self.shortlist
        chosen: dict[str, int] = {}  # worker_id -> matched blocks
        for pool, order in self._order.items():
            if role is not None and pool != role:
                continue
            pool_slots, slot_rank = self._pool_slots[pool], self._slot_rank[pool]
            need = k
            for depth, slots in levels:
                if need <= 0:
                    break
                in_pool = slots & pool_slots
                if len(in_pool) > need:
                    in_pool = set(_least_loaded(in_pool, need, slot_rank, self._order_slots[pool]))
                for slot in in_pool:
                    member = view.member(slot)
                    if member is not None:
                        chosen[member[0]] = depth
                need -= len(in_pool)
            for worker_id, slot in zip(order[:k], self._order_slots[pool], strict=False):
                if worker_id not in chosen:
                    chosen[worker_id] = next((d for d, held in levels if slot in held), 0)
        out = Shortlist()
        for worker_id in sorted(chosen):
            entry = self.live.get(worker_id)
            if entry is not None and entry[1] > now:
                out[worker_id] = _result(view, block_hashes, entry[0], chosen[worker_id])
        out.live = self.live.keys()
        return out

    async def live_workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Redis's answer: callers that ask this want the truth, not a view."""
        return await self.index.live_workers(role)

    # -- the background task ---------------------------------------------------------

    def start(self) -> None:
        """Starts following, again after `close` too (idempotent; needs a running event
        loop). Matches and waits start it themselves until it is closed."""
        self._closing = False
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._closing:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stops following, within about a second (one blocking read)."""
        self._closing = True
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        # NOTE: a cancel that lands as redis-py's `asyncio.wait_for` completes is lost
        # on Python 3.11; the flag then ends the loop after the read in progress.
        done, _ = await asyncio.wait([task], timeout=_MAX_BLOCK_MS / 1000 + _CLOSE_SLACK_S)
        if not done:
            logger.warning("prefix index follower did not stop within %.1f s", _CLOSE_SLACK_S)
        elif not task.cancelled() and task.exception() is not None:
            logger.warning("prefix index follower failed", exc_info=task.exception())

    def stop(self) -> None:
        """`close` without waiting (a replica's teardown, outside the loop's tasks)."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def wait_caught_up(self, timeout_s: float) -> None:
        """Waits until every event Redis has now is in the view and the live workers
        were read after the last registration (tests, benchmarks).

        Raises:
            TimeoutError: not within `timeout_s`.
        """
        self._ensure_started()
        target = await self.index.events_seq()
        await self.wait_until(
            lambda: (
                self.view is not None
                and self._resnapshot is None
                and self.applied_seq >= target
                and not self._refresh_now.is_set()
            ),
            timeout_s,
        )

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Waits until `predicate()` holds, checked after each change of the follower's
        state (a snapshot, events applied, a live read, a lost connection).

        Raises:
            TimeoutError: not within `timeout_s`.
        """
        self._ensure_started()
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(predicate)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closing:
            _raise_if_cancelled()
            try:
                if self._resnapshot is not None:
                    await self._snapshot(self._resnapshot)
                await self._follow()
                backoff = 0.05
            except (RedisError, OSError, TimeoutError) as exc:
                level = logging.WARNING if self.connected else logging.DEBUG
                logger.log(
                    level, "prefix index events unreadable (%s): matching from the last view", exc
                )
                self.connected = False
                await self._notify()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
            except Exception:  # a bug here must not end following for good
                logger.exception("prefix index follower failed; taking a new snapshot")
                self._resnapshot = "error"
                await asyncio.sleep(_MAX_BACKOFF_S)

    async def _follow(self) -> None:
        """Reads events until the next live read is due, then does it."""
        due = self.live_read_at + self.refresh_s
        while self._resnapshot is None and not self._closing:
            _raise_if_cancelled()
            left_ms = int((due - self._clock()) * 1000)
            if left_ms <= 0 or self._refresh_now.is_set():
                await self._read_live()
                due = self.live_read_at + self.refresh_s
                continue
            events = await self.index.read_events(self.last_id, min(left_ms, _MAX_BLOCK_MS))
            self.connected = True
            self._apply(events)
            await self._notify()

    async def _snapshot(self, reason: str) -> None:
        seq, last_id = await self.index.stream_position()
        epoch, table = await self.index.live_table()
        now = self._clock()
        view = IndexView()
        regs = [(w.worker_id, w.generation) for w, _ in table]
        for i in range(0, len(regs), _SNAPSHOT_BATCH):
            batch = regs[i : i + _SNAPSHOT_BATCH]
            helds, tiers = await self.index.held(batch), await self.index.tiers(batch)
            for (worker_id, generation), held, tier in zip(batch, helds, tiers, strict=True):
                view.store_keys(worker_id, generation, (hex_key(h) for h in held))
                view.set_tiers(worker_id, generation, {hex_key(h): t for h, t in tier.items()})
        self.view = view
        self.applied_seq, self.last_id, self.epoch = seq, last_id, epoch
        self._set_live(table, now)
        self._refresh_now.clear()
        self.connected = True
        self._resnapshot = None
        self.snapshots[reason] += 1
        if self._on_snapshot is not None:
            self._on_snapshot(reason)
        if reason != "start":
            logger.info("prefix index view rebuilt (%s): %d blocks", reason, len(view))
        await self._notify()

    async def _read_live(self) -> None:
        epoch, table = await self.index.live_table()
        self.connected = True
        if epoch != self.epoch:
            self._resnapshot = "restart"
            return
        self._set_live(table, self._clock())
        if self.view is not None:
            self.view.drop_all_but({w.worker_id: w.generation for w, _ in table})
        self._refresh_now.clear()
        await self._notify()

    def _set_live(self, table: Sequence[tuple[WorkerInfo, int]], now: float) -> None:
        self.live = {w.worker_id: (w, now + ttl_ms / 1000) for w, ttl_ms in table}
        self.live_read_at = now
        if self.shortlist is None or self.view is None:
            return
        view = self.view
        self._order, self._order_slots = {}, {}
        for w, _ in sorted(table, key=lambda row: _load_key(row[0])):
            self._order.setdefault(w.role, []).append(w.worker_id)
            slot = view.slot_of(w.worker_id, w.generation, create=True)
            assert slot is not None
            self._order_slots.setdefault(w.role, []).append(slot)
        self._slot_rank = {
            role: {slot: i for i, slot in enumerate(slots)}
            for role, slots in self._order_slots.items()
        }
        self._pool_slots = {role: set(slots) for role, slots in self._order_slots.items()}

    def _apply(self, events: Sequence[StreamEvent]) -> None:
        view = self.view
        assert view is not None
        wall_ms = time.time() * 1000
        for event in events:
            if event.seq != self.applied_seq + 1:
                self._resnapshot = "gap" if event.seq > self.applied_seq else "restart"
                return
            worker_id, generation = split_member(event.member)
            if event.kind == "p":
                view.apply_ops(worker_id, generation, event.ops)
            elif event.kind == "r":
                view.drop_older(worker_id, generation)
                self._refresh_now.set()
            elif event.kind == "d":
                view.drop(worker_id, generation)
                entry = self.live.get(worker_id)
                if entry is not None and entry[0].generation == generation:
                    del self.live[worker_id]
            self.applied_seq, self.last_id = event.seq, event.entry_id
            lag_s = max(wall_ms - int(event.entry_id.partition("-")[0]), 0.0) / 1000
            self.lags_s.append(lag_s)
            if self._on_lag is not None:
                self._on_lag(lag_s)

    def _count_match(self, source: str) -> None:
        self.matches[source] += 1
        if self._on_match is not None:
            self._on_match(source)


def _result(
    view: IndexView, block_hashes: Sequence[BlockHash], worker: WorkerInfo, matched: int
) -> MatchResult:
    """A worker's match, with how many of its matched blocks are only in a lower tier."""
    host, disk = view.tier_counts(block_hashes, worker.worker_id, worker.generation, matched)
    return MatchResult(worker, matched, host, disk)


class Shortlist(dict[str, MatchResult]):
    """A shortlisted match: the workers placement scores, and (`live`) every live
    worker's id, for what the router keeps per worker."""

    live: Collection[str] = ()


Levels = list[tuple[int, set[int]]]


def _raise_if_cancelled() -> None:
    """Ends the task if a cancel was requested but lost: on Python 3.11, one that lands
    as redis-py's `asyncio.wait_for` completes is swallowed, and a loop of Redis calls
    would then run on (asyncio.run's shutdown waits for it forever)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _least_loaded(slots: set[int], n: int, rank: dict[int, int], order: list[int]) -> list[int]:
    """The `n` of `slots` that come first in `order` (least loaded first): by walking
    the order when `slots` is most of it, else by their ranks."""
    if len(slots) * 8 >= len(order):
        picked = []
        for slot in order:
            if slot in slots:
                picked.append(slot)
                if len(picked) == n:
                    break
        return picked
    return heapq.nsmallest(n, slots, key=rank.__getitem__)


def _load_key(w: WorkerInfo) -> tuple[float, float]:
    """How loaded a worker was at the last live read, for the shortlist: a prefill
    worker by the seconds its queue takes, a decode worker by its sequences and then its
    KV pool's use."""
    load = w.load
    if w.role == "prefill":
        rate = load.get("prefill_tokens_per_s", 0) or 1
        return load.get("queued_prefill_tokens", 0) / rate, 0.0
    used = load.get("kv_blocks_used", 0) / max(load.get("kv_blocks_total", 0), 1)
    return float(load.get("running", 0) + load.get("waiting", 0)), used


def follower_stats(follower: IndexFollower) -> dict[str, Any]:
    """What a follower has done, for logs and benchmarks."""
    return {
        "snapshots": dict(follower.snapshots),
        "matches": dict(follower.matches),
        "applied_seq": follower.applied_seq,
        "blocks": len(follower.view) if follower.view is not None else 0,
        "connected": follower.connected,
    }
