"""The router's in-memory index view (cluster/index_view.py): the Lua match's answers.

The first tests pin the rules on small cases; the replay feeds one random history of
registrations, STORED/REMOVED events, re-registrations and deregistrations to both a
real Redis index (`PrefixIndex`, a redis-server of its own) and the view, and checks that
every match returns the same holders (issue 43, item 4).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from pdserve.cluster.index_view import IndexView, block_key
from pdserve.cluster.prefix_index import PrefixIndex, WorkerInfo
from pdserve.common.hashing import hash_block_chain, hash_namespace
from pdserve.common.kv_events import KVEvent, KVEventKind
from pdserve.deploy.redis_server import EmbeddedRedis

NS = hash_namespace("m")


def chain(tokens: list[int]) -> list[bytes]:
    return hash_block_chain(tokens, 4, NS)


def stored(hashes: list[bytes]) -> KVEvent:
    return KVEvent(KVEventKind.STORED, tuple(hashes))


def removed(hashes: list[bytes]) -> KVEvent:
    return KVEvent(KVEventKind.REMOVED, tuple(hashes))


A = chain(list(range(40)))  # 10 blocks
B = chain([7, *range(1, 40)])  # 10 blocks sharing nothing with A


def test_a_match_counts_leading_blocks_per_live_worker() -> None:
    view = IndexView()
    view.apply("w1", 1, [stored(A[:6])])
    view.apply("w2", 1, [stored(A[:3]), stored(A[4:8])])  # a hole at block 3
    view.apply("w3", 1, [stored(B)])
    live = {"w1": 1, "w2": 1, "w3": 1, "w4": 1}
    assert view.match(A, live) == {"w1": 6, "w2": 3, "w3": 0, "w4": 0}
    assert view.match(B[:4], live) == {"w1": 0, "w2": 0, "w3": 4, "w4": 0}
    assert view.match([], live) == dict.fromkeys(live, 0)
    assert view.match(A, {}) == {}


def test_entries_of_a_stale_or_dropped_registration_never_count() -> None:
    view = IndexView()
    view.apply("w1", 1, [stored(A)])
    assert view.match(A, {"w1": 2}) == {"w1": 0}  # w1 registered again: generation 2
    view.apply("w1", 2, [stored(A[:2])])
    assert view.match(A, {"w1": 2}) == {"w1": 2}
    assert view.drop_all_but({"w1": 2}) == len(A)  # generation 1's entries go
    assert view.registrations == [("w1", 2)]
    assert view.drop("w1") == 2 and len(view) == 0


def test_removed_blocks_and_shared_blocks() -> None:
    view = IndexView()
    view.apply("w1", 1, [stored(A), removed(A[5:])])
    view.apply("w2", 1, [stored(A[:8]), stored(A[:8])])  # a repeat is idempotent
    live = {"w1": 1, "w2": 1}
    assert view.match(A, live) == {"w1": 5, "w2": 8}
    view.remove("w2", 1, A[:1])  # w2 lost block 0: it matches nothing now
    assert view.match(A, live) == {"w1": 5, "w2": 0}
    view.remove("w9", 1, A)  # unknown registration: nothing happens
    assert len(view) == 10 - 2  # blocks 0..4 (w1) and 1..7 (w2): 8 distinct blocks
    assert block_key(A[0]) == int.from_bytes(A[0][:8], "little")


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


KINDS = (
    KVEventKind.STORED,
    KVEventKind.DEMOTED_HOST,
    KVEventKind.DEMOTED_DISK,
    KVEventKind.REMOVED,
)


def test_a_replayed_history_gives_the_lua_match_s_holders(redis_url: str) -> None:
    """Registrations, restarts, and every kind of event (a block stored, moved to host
    memory or disk, removed), each applied to Redis and to the view: at every step the
    view's counts and tiers equal the Lua match's."""
    asyncio.run(_replay(redis_url))


async def _replay(url: str) -> None:
    rng = random.Random(43)
    client = aioredis.from_url(url)
    try:
        await client.flushall()
        index = PrefixIndex(client, "m", lease_s=60.0)
        view = IndexView()
        prompts = [
            [rng.randrange(5) for _ in range(4 * 3)] + [rng.randrange(500) for _ in range(40)]
            for _ in range(12)
        ]  # shared leading blocks across prompts
        chains = [chain(p) for p in prompts]
        generation: dict[str, int] = {}
        for w in range(6):
            worker_id = f"w{w}"
            generation[worker_id] = await index.register(WorkerInfo(worker_id, "prefill", "a"))
        for _ in range(300):
            worker_id = f"w{rng.randrange(6)}"
            roll = rng.random()
            if roll < 0.03:  # the worker restarts: a new generation, nothing held yet
                gen = await index.register(WorkerInfo(worker_id, "prefill", "a"))
                generation[worker_id] = gen
            elif roll < 0.05:
                await index.deregister(worker_id, generation[worker_id])
                view.drop(worker_id, generation[worker_id])
                generation[worker_id] = await index.register(WorkerInfo(worker_id, "prefill", "a"))
            else:
                c = rng.choice(chains)
                lo, hi = sorted(rng.sample(range(len(c) + 1), 2))
                kind = rng.choices(KINDS, weights=(0.5, 0.15, 0.1, 0.25))[0]
                events = [KVEvent(kind, tuple(c[lo:hi]))]
                assert await index.publish(worker_id, generation[worker_id], events)
                view.apply(worker_id, generation[worker_id], events)
            live = {w.worker_id: w.generation for w in await index.live_workers()}
            assert live == generation
            for c in rng.sample(chains, 3):
                results = await index.match(c)
                want = {w: r.matched_blocks for w, r in results.items()}
                assert view.match(c, live) == want
                for w, r in results.items():  # and of those blocks, the ones in a tier
                    tiers = view.tier_counts(c, w, live[w], r.matched_blocks)
                    assert tiers == (r.host_blocks, r.disk_blocks), (w, r)
                by_level = {}  # the same holders, from the walk the router's shortlist uses
                for depth, slots in view.levels(c):
                    for slot in slots:
                        member = view.member(slot)
                        if member is not None and live.get(member[0]) == member[1]:
                            by_level[member[0]] = depth
                assert by_level == {w: n for w, n in want.items() if n}
        view.drop_all_but(live)
        assert {w for w, _ in view.registrations} <= set(live)
    finally:
        await client.aclose()
