"""A router's in-memory prefix index (cluster/index_follower.py) against the Lua match.

Each test plays workers through a real `PrefixIndex` on a redis-server of its own and
checks that the follower, fed only by the events stream and its snapshots, answers every
match as the Lua script does (issue 43, items 1, 3 and 4): from its first snapshot, while
following, after it fell behind the stream's length (a gap), after Redis restarted empty,
and for a router started late. Redis down, it goes on from its last view, counted.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from pdserve.cluster.index_follower import IndexFollower
from pdserve.cluster.prefix_index import MatchResult, PrefixIndex, WorkerInfo
from pdserve.common.hashing import hash_block_chain, hash_namespace
from pdserve.common.kv_events import KVEvent, KVEventKind
from pdserve.deploy.redis_server import EmbeddedRedis
from tests.router.fakes import in_loop

pytestmark = pytest.mark.redis

NS = hash_namespace("m")
WAIT_S = 10.0
STREAM_LEN = 100


def chain(tokens: list[int]) -> list[bytes]:
    return hash_block_chain(tokens, 4, NS)


def counts(matches: dict[str, MatchResult]) -> dict[str, tuple[int, int, int, int]]:
    """worker -> (generation, matched blocks, of those in host memory, on disk)."""
    return {
        w: (m.worker.generation, m.matched_blocks, m.host_blocks, m.disk_blocks)
        for w, m in matches.items()
    }


class Fleet:
    """Workers played through the index, with random prompts sharing leading blocks."""

    def __init__(self, index: PrefixIndex, seed: int) -> None:
        self.index = index
        self.rng = random.Random(seed)
        rng = self.rng
        prompts = [
            [rng.randrange(5) for _ in range(4 * 3)] + [rng.randrange(500) for _ in range(40)]
            for _ in range(12)
        ]
        self.chains = [chain(p) for p in prompts]
        self.generation: dict[str, int] = {}

    async def register(self, worker_id: str) -> None:
        role = "prefill" if int(worker_id[1:]) % 2 else "decode"
        self.generation[worker_id] = await self.index.register(WorkerInfo(worker_id, role, "a"))

    async def step(self) -> None:
        """One random change: mostly a publish, sometimes a restart or a deregistration."""
        rng = self.rng
        worker_id = rng.choice(sorted(self.generation))
        roll = rng.random()
        if roll < 0.03:
            await self.register(worker_id)
        elif roll < 0.05:
            await self.index.deregister(worker_id, self.generation[worker_id])
            await self.register(worker_id)
        else:
            c = rng.choice(self.chains)
            lo, hi = sorted(rng.sample(range(len(c) + 1), 2))
            kinds = (KVEventKind.STORED, KVEventKind.DEMOTED_HOST, KVEventKind.DEMOTED_DISK)
            kind = rng.choices([*kinds, KVEventKind.REMOVED], weights=(0.5, 0.15, 0.1, 0.25))[0]
            events = [KVEvent(kind, tuple(c[lo:hi]))]
            assert await self.index.publish(worker_id, self.generation[worker_id], events)

    async def check(self, follower: IndexFollower, samples: int = 3) -> None:
        """The follower's matches equal the Lua script's, for all and for each role."""
        await follower.wait_caught_up(WAIT_S)
        for c in self.rng.sample(self.chains, samples):
            for role in (None, "prefill", "decode"):
                want = counts(await self.index.match(c, role))
                assert counts(await follower.match(c, role)) == want, role


@pytest.fixture
def redis_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.stop()


def make_index(url: str, lease_s: float = 60.0) -> PrefixIndex:
    client = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    return PrefixIndex(client, "m", lease_s=lease_s, stream_len=STREAM_LEN)


async def closing(*followers: IndexFollower) -> None:
    for f in followers:
        await f.close()
        await f.index._redis.aclose()


@in_loop
async def test_a_followed_history_gives_the_lua_match_s_holders(
    redis_server: EmbeddedRedis,
) -> None:
    """Replay: registrations, publishes, restarts and deregistrations, each checked; a
    router that starts halfway converges from its snapshot."""
    workers = make_index(redis_server.url)
    fleet = Fleet(workers, seed=43)
    for w in range(6):
        await fleet.register(f"w{w}")
    first = IndexFollower(make_index(redis_server.url), refresh_s=0.5)
    late = IndexFollower(make_index(redis_server.url), refresh_s=0.5)
    # a pool no larger than the shortlist: every worker, as the router's matches see it
    short = IndexFollower(make_index(redis_server.url), refresh_s=0.5, shortlist=3)
    try:
        for i in range(200):
            await fleet.step()
            await fleet.check(first)
            await fleet.check(short, samples=1)
            if i >= 100:
                await fleet.check(late)
        assert first.snapshots == {"start": 1} and late.snapshots == {"start": 1}
        assert first.matches["memory"] > 0 and set(first.matches) == {"memory"}
        assert len(first.lags_s) > 0 and max(first.lags_s) < WAIT_S
    finally:
        await closing(first, late, short)
        await workers._redis.aclose()


@in_loop
async def test_a_router_behind_the_stream_detects_the_gap_and_resnapshots(
    redis_server: EmbeddedRedis,
) -> None:
    workers = make_index(redis_server.url)
    fleet = Fleet(workers, seed=7)
    for w in range(4):
        await fleet.register(f"w{w}")
    follower = IndexFollower(make_index(redis_server.url), refresh_s=0.5)
    try:
        await fleet.check(follower)
        await follower.close()  # cut off: what it misses is trimmed from the stream
        seq_before = follower.applied_seq
        for _ in range(10 * STREAM_LEN):
            await fleet.step()
        follower.start()
        first_left = await workers._redis.xrange(workers.key("events"), count=1)
        assert int(first_left[0][1][b"n"]) > seq_before + 1, "the stream was not trimmed"
        await fleet.check(follower, samples=6)
        assert follower.snapshots == {"start": 1, "gap": 1}
        # cut off again, killed mid-read this time: nothing lost, so no new snapshot
        await workers._redis.execute_command("CLIENT", "KILL", "TYPE", "normal")
        for _ in range(20):
            await fleet.step()
        await fleet.check(follower, samples=6)
        assert follower.snapshots == {"start": 1, "gap": 1}
    finally:
        await closing(follower)
        await workers._redis.aclose()


@in_loop
async def test_redis_restarted_matches_go_on_from_the_view_then_it_resnapshots(
    redis_server: EmbeddedRedis,
) -> None:
    workers = make_index(redis_server.url)
    fleet = Fleet(workers, seed=11)
    for w in range(4):
        await fleet.register(f"w{w}")
    for _ in range(40):
        await fleet.step()
    follower = IndexFollower(make_index(redis_server.url), refresh_s=0.2)
    try:
        await fleet.check(follower)
        before = {tuple(c): counts(await follower.match(c)) for c in fleet.chains}
        redis_server.stop()
        await follower.wait_until(lambda: not follower.connected, WAIT_S)
        for c in fleet.chains:  # the last view answers, counted as stale
            assert counts(await follower.match(c)) == before[tuple(c)]
        assert follower.matches["stale"] == len(fleet.chains)

        redis_server.start()  # the same port, empty: the workers register again
        fleet.generation.clear()
        for w in range(4):
            await fleet.register(f"w{w}")
        for _ in range(40):
            await fleet.step()
        await fleet.check(follower, samples=6)
        assert follower.snapshots["restart"] == 1, follower.snapshots
    finally:
        await closing(follower)
        await workers._redis.aclose()


@in_loop
async def test_a_lapsed_lease_leaves_the_view_when_it_ends(redis_server: EmbeddedRedis) -> None:
    """A worker that stops heartbeating is gone from the follower's matches at the end of
    its lease as Redis told it, not at the next live read (30 s away here); the clock is
    the test's, so the lease ends when the test says."""
    workers = make_index(redis_server.url, lease_s=1.0)
    fleet = Fleet(workers, seed=3)
    await fleet.register("w0")
    c = fleet.chains[0]
    assert await workers.publish(
        "w0", fleet.generation["w0"], [KVEvent(KVEventKind.STORED, tuple(c))]
    )
    now = [1000.0]
    follower = IndexFollower(make_index(redis_server.url), refresh_s=30.0, clock=lambda: now[0])
    try:
        await follower.wait_caught_up(WAIT_S)
        assert counts(await follower.match(c)) == {"w0": (fleet.generation["w0"], len(c), 0, 0)}
        now[0] += 0.5
        assert counts(await follower.match(c)) == {"w0": (fleet.generation["w0"], len(c), 0, 0)}
        now[0] += 0.51  # past the 1 s lease as the snapshot read it
        assert await follower.match(c) == {}
        assert follower.matches == {"memory": 3}
    finally:
        await closing(follower)
        await workers._redis.aclose()


@in_loop
async def test_a_shortlist_keeps_the_longest_holders_and_the_least_loaded(
    redis_server: EmbeddedRedis,
) -> None:
    """40 workers a pool, a shortlist of 3: a match names the 3 holders of the longest
    prefix (the least loaded first among equals) and the 3 least loaded workers of each
    pool, whatever the fleet's size, and every live worker apart."""
    workers = make_index(redis_server.url)
    c = chain(list(range(40)))  # 10 blocks
    generation = {}
    for i in range(80):
        role = "prefill" if i % 2 else "decode"
        load = {"queued_prefill_tokens": 1000 - i} if role == "prefill" else {"running": 80 - i}
        w = f"w{i:02d}"
        generation[w] = await workers.register(WorkerInfo(w, role, "a", load=load))
        held = c[: 1 + i % 10]  # w09, w19, ... hold all 10 blocks
        assert await workers.publish(w, generation[w], [KVEvent(KVEventKind.STORED, tuple(held))])
    follower = IndexFollower(make_index(redis_server.url), refresh_s=0.5, shortlist=3)
    try:
        await follower.wait_caught_up(WAIT_S)
        got = counts(await follower.match(c))
        full = await workers.match(c)
        assert {w: n for w, (_, n, _, _) in got.items()} == {
            # the longest holders, the least loaded first (loads fall as i grows)
            "w79": 10,
            "w69": 10,
            "w59": 10,  # prefill
            "w78": 9,
            "w68": 9,
            "w58": 9,  # decode: even ids, so 9 blocks at most
            # the least loaded of each pool
            "w77": 8,
            "w75": 6,  # prefill (w79 is both)
            "w76": 7,
            "w74": 5,  # decode (w78 is both)
        }
        assert all(full[w].matched_blocks == n for w, (_, n, _, _) in got.items())
        shortlist = await follower.match(c)
        assert set(getattr(shortlist, "live", ())) == set(generation)
        only_decode = await follower.match(c, "decode")
        assert set(only_decode) == {"w78", "w68", "w58", "w76", "w74"}
    finally:
        await closing(follower)
        await workers._redis.aclose()
