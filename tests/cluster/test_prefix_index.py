"""The Redis prefix index against a real redis-server (see conftest.py).

Async bodies run under asyncio.run inside plain tests, so no pytest-asyncio is needed.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from pdserve.cluster.prefix_index import (
    KVFormatMismatchError,
    PrefixIndex,
    ReapResult,
    WorkerInfo,
)
from pdserve.common.hashing import BlockHash, hash_block_chain, hash_namespace
from pdserve.common.kv_events import KVEvent, KVEventKind

MODEL = "demo-model"
BLOCK_SIZE = 4
LONG_LEASE_S = 30.0
SHORT_LEASE_S = 0.3
EXPIRY_DEADLINE_S = 5.0

CHAIN = hash_block_chain(list(range(10 * BLOCK_SIZE)), BLOCK_SIZE, hash_namespace(MODEL))
# CHAIN's tokens under a cache salt: no block hash in common.
SALTED = hash_block_chain(
    list(range(10 * BLOCK_SIZE)), BLOCK_SIZE, hash_namespace(MODEL, cache_salt="tenant")
)
# Shares CHAIN's first 2 blocks, then diverges.
FORK = hash_block_chain(
    [*range(2 * BLOCK_SIZE), *range(500, 500 + 3 * BLOCK_SIZE)], BLOCK_SIZE, hash_namespace(MODEL)
)


def prefill(worker_id: str, **load: int) -> WorkerInfo:
    return WorkerInfo(worker_id, "prefill", f"{worker_id}.local:7000", load=load)


def decode(worker_id: str, **load: int) -> WorkerInfo:
    return WorkerInfo(worker_id, "decode", f"{worker_id}.local:7000", load=load)


def stored(hashes: Sequence[BlockHash]) -> list[KVEvent]:
    return [KVEvent(KVEventKind.STORED, tuple(hashes))]


def removed(hashes: Sequence[BlockHash]) -> list[KVEvent]:
    return [KVEvent(KVEventKind.REMOVED, tuple(hashes))]


def counts(results: dict[str, Any]) -> dict[str, int]:
    return {worker_id: r.matched_blocks for worker_id, r in results.items()}


def raw_client(url: str) -> redis.Redis:
    """A sync client for inspecting keys directly; replies decoded to str."""
    return redis.Redis.from_url(url, decode_responses=True)


@asynccontextmanager
async def _sync_client(url: str) -> AsyncIterator[redis.Redis]:
    """A sync client for raw inspection, closable from an `async with` list."""
    with raw_client(url) as client:
        yield client


@asynccontextmanager
async def open_index(
    url: str, model: str = MODEL, lease_s: float = LONG_LEASE_S, decode_responses: bool = False
) -> AsyncIterator[PrefixIndex]:
    client = aioredis.Redis.from_url(url, decode_responses=decode_responses)
    try:
        yield PrefixIndex(client, model, lease_s=lease_s)
    finally:
        await client.aclose()


async def wait_until_gone(index: PrefixIndex, worker_id: str) -> None:
    deadline = time.monotonic() + EXPIRY_DEADLINE_S
    while any(w.worker_id == worker_id for w in await index.live_workers()):
        assert time.monotonic() < deadline, f"{worker_id}'s lease did not expire"
        await asyncio.sleep(0.02)


def test_match_counts_leading_blocks_per_worker(redis_url: str) -> None:
    async def body() -> None:
        async with open_index(redis_url) as index:
            gen_a = await index.register(prefill("A", queued_prefill_tokens=7))
            gen_b = await index.register(prefill("B"))
            await index.register(decode("C", free_blocks=90, total_blocks=100))
            assert await index.publish("A", gen_a, stored(CHAIN))
            assert await index.publish("B", gen_b, stored([*CHAIN[0:4], *CHAIN[5:7]]))

            results = await index.match(CHAIN)
            assert counts(results) == {"A": 10, "B": 4, "C": 0}
            assert results["A"].worker == WorkerInfo(
                "A", "prefill", "A.local:7000", gen_a, {"queued_prefill_tokens": 7}
            )
            assert results["C"].worker.load == {"free_blocks": 90, "total_blocks": 100}
            assert counts(await index.match(CHAIN[:3])) == {"A": 3, "B": 3, "C": 0}
            assert counts(await index.match(FORK)) == {"A": 2, "B": 2, "C": 0}
            assert counts(await index.match(SALTED)) == {"A": 0, "B": 0, "C": 0}
            assert counts(await index.match(CHAIN, role="decode")) == {"C": 0}
            assert counts(await index.match(CHAIN, role="prefill")) == {"A": 10, "B": 4}

    asyncio.run(body())


def test_removed_events_lower_the_count(redis_url: str) -> None:
    async def body() -> None:
        async with open_index(redis_url) as index:
            gen = await index.register(decode("D"))
            await index.publish("D", gen, stored(CHAIN))
            await index.publish("D", gen, removed(CHAIN[5:6]))
            assert counts(await index.match(CHAIN)) == {"D": 5}
            # Events apply in order: stored then removed in one batch ends removed.
            await index.publish("D", gen, [*stored(CHAIN[5:6]), *removed(CHAIN[0:1])])
            assert counts(await index.match(CHAIN)) == {"D": 0}
            await index.publish("D", gen, stored(CHAIN[0:1]))
            assert counts(await index.match(CHAIN)) == {"D": 10}

    asyncio.run(body())


def test_a_block_keeps_its_tier_until_it_is_stored_again_or_removed(redis_url: str) -> None:
    host, disk = KVEventKind.DEMOTED_HOST, KVEventKind.DEMOTED_DISK

    def tiered(results: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
        return {w: (r.matched_blocks, r.host_blocks, r.disk_blocks) for w, r in results.items()}

    async def body() -> None:
        async with open_index(redis_url) as index:
            gen = await index.register(decode("D"))
            gen_e = await index.register(decode("E"))
            await index.publish("D", gen, stored(CHAIN))
            await index.publish("E", gen_e, stored(CHAIN[:4]))
            assert tiered(await index.match(CHAIN)) == {"D": (10, 0, 0), "E": (4, 0, 0)}
            # blocks 2-4 left the pool for host memory, 3 went on to disk: still held
            await index.publish(
                "D", gen, [KVEvent(host, tuple(CHAIN[2:5])), KVEvent(disk, (CHAIN[3],))]
            )
            assert tiered(await index.match(CHAIN)) == {"D": (10, 2, 1), "E": (4, 0, 0)}
            # only the matched blocks count: a chain through block 2
            assert tiered(await index.match(CHAIN[:3])) == {"D": (3, 1, 0), "E": (3, 0, 0)}
            # promoted back (STORED), then a tiered block dropped (REMOVED)
            await index.publish("D", gen, [*stored(CHAIN[2:3]), *removed(CHAIN[4:5])])
            assert tiered(await index.match(CHAIN)) == {"D": (4, 0, 1), "E": (4, 0, 0)}
            assert tiered(await index.match(CHAIN, role="decode"))["D"] == (4, 0, 1)
            # a worker that registers again starts with no tier entries, and its old
            # registration's are reaped with its block entries
            gen2 = await index.register(decode("D"))
            await index.publish("D", gen2, stored(CHAIN))
            assert tiered(await index.match(CHAIN))["D"] == (10, 0, 0)
            assert (await index.reap()).num_registrations == 1
            with raw_client(redis_url) as raw:
                assert raw.keys(index.key("tier:*")) == []
            assert await index.tiers([("D", gen2)]) == [{}]

    asyncio.run(body())


def test_heartbeat_renews_lease_and_updates_load(redis_url: str) -> None:
    async def body() -> None:
        async with open_index(redis_url) as index:
            gen = await index.register(decode("D", running=0, free_blocks=10))
            with raw_client(redis_url) as raw:
                raw.pexpire(index.key("worker:D"), 500)  # as if most of the lease had run
                assert await index.heartbeat("D", gen, {"running": 5})
                assert raw.pttl(index.key("worker:D")) > 500  # renewed to a full lease
            [worker] = await index.live_workers()
            assert worker.load == {"running": 5, "free_blocks": 10}
            assert not await index.heartbeat("D", gen + 1, {"running": 6})
            with pytest.raises(ValueError):
                await index.heartbeat("D", gen, {"generation": 1})

    asyncio.run(body())


def test_expired_worker_is_never_counted_and_is_reaped(redis_url: str) -> None:
    async def body() -> None:
        async with (
            open_index(redis_url) as index,
            open_index(redis_url, lease_s=SHORT_LEASE_S) as short_index,
            _sync_client(redis_url) as raw,
        ):
            gen_a = await index.register(prefill("A"))
            gen_b = await short_index.register(prefill("B"))
            await index.publish("A", gen_a, stored(CHAIN[:4]))
            await short_index.publish("B", gen_b, stored(CHAIN))
            assert counts(await index.match(CHAIN)) == {"A": 4, "B": 10}

            await wait_until_gone(index, "B")
            assert raw.sismember(index.key(f"block:{CHAIN[0].hex()}"), f"B:{gen_b}")
            assert counts(await index.match(CHAIN)) == {"A": 4}
            assert counts(await index.match(CHAIN[4:])) == {"A": 0}
            assert not await short_index.heartbeat("B", gen_b, {})
            assert not await short_index.publish("B", gen_b, stored(FORK))
            assert not raw.exists(index.key(f"block:{FORK[-1].hex()}"))

            assert await index.reap() == ReapResult(1, 5)  # match lazily reaped blocks 0-4
            assert _members(raw, index) == {f"A:{gen_a}"}
            assert not raw.exists(index.key(f"held:B:{gen_b}"))
            assert await index.reap() == ReapResult(0, 0)

    asyncio.run(body())


def test_restarted_worker_gets_no_credit_until_it_republishes(redis_url: str) -> None:
    async def body() -> None:
        async with open_index(redis_url) as index:
            old_gen = await index.register(decode("D"))
            await index.publish("D", old_gen, stored(CHAIN))
            new_gen = await index.register(decode("D"))
            assert new_gen > old_gen

            results = await index.match(CHAIN)
            assert counts(results) == {"D": 0}
            assert results["D"].worker.generation == new_gen
            assert not await index.heartbeat("D", old_gen, {})
            assert not await index.publish("D", old_gen, stored(CHAIN))
            assert await index.publish("D", new_gen, stored(CHAIN[:3]))
            assert counts(await index.match(CHAIN)) == {"D": 3}

            assert (await index.reap()).num_registrations == 1
            with raw_client(redis_url) as raw:
                assert _members(raw, index) == {f"D:{new_gen}"}

    asyncio.run(body())


def test_match_and_publish_are_one_round_trip(redis_url: str) -> None:
    async def body() -> None:
        async with open_index(redis_url) as index:
            gen = await index.register(prefill("A"))
            await index.publish("A", gen, [])
            await index.match([])  # loads the scripts (NOSCRIPT -> SCRIPT LOAD)
            calls: list[tuple[Any, ...]] = []
            execute = index._redis.execute_command

            async def counting(*args: Any, **kwargs: Any) -> Any:
                calls.append(args)
                return await execute(*args, **kwargs)

            index._redis.execute_command = counting  # type: ignore[method-assign]
            with raw_client(redis_url) as raw:
                raw.config_resetstat()
                await index.publish("A", gen, [*stored(CHAIN), *removed(CHAIN[4:5])])
                assert counts(await index.match(CHAIN)) == {"A": 4}
                assert raw.info("commandstats")["cmdstat_evalsha"]["calls"] == 2
            assert [args[0] for args in calls] == ["EVALSHA", "EVALSHA"]

    asyncio.run(body())


def test_deregister_and_reap_leave_nothing_behind(redis_url: str) -> None:
    async def body() -> None:
        async with open_index(redis_url) as index:
            gen_a = await index.register(prefill("A"))
            gen_b = await index.register(decode("B:with:colons"))
            await index.publish("A", gen_a, stored(CHAIN))
            await index.publish("B:with:colons", gen_b, stored(FORK))
            demoted = [KVEvent(KVEventKind.DEMOTED_DISK, tuple(FORK[:2]))]
            await index.publish("B:with:colons", gen_b, demoted)
            assert await index.tiers([("B:with:colons", gen_b)]) == [
                {h.hex(): "d" for h in FORK[:2]}
            ]
            assert not await index.deregister("A", gen_a + 100)  # not that registration
            assert await index.deregister("A", gen_a)
            assert await index.deregister("B:with:colons")
            assert await index.match(CHAIN) == {}
            assert await index.reap() == ReapResult(0, 0)
            with raw_client(redis_url) as raw:
                # Only the generation counter stays, so generations never repeat.
                assert raw.keys("*") == [index.key("generation")]

    asyncio.run(body())


def test_models_do_not_share_entries(redis_url: str) -> None:
    async def body() -> None:
        async with (
            open_index(redis_url) as index,
            open_index(redis_url, "other", decode_responses=True) as other,
        ):
            gen = await index.register(prefill("A"))
            await index.publish("A", gen, stored(CHAIN))
            await other.register(prefill("Z"))
            assert counts(await index.match(CHAIN)) == {"A": 10}
            assert counts(await other.match(CHAIN)) == {"Z": 0}
            assert [w.worker_id for w in await other.live_workers("prefill")] == ["Z"]

    asyncio.run(body())


@pytest.mark.parametrize(
    "worker",
    [
        WorkerInfo("", "prefill", "x"),
        WorkerInfo("A", "encoder", "x"),
        prefill("A", generation=3),
        WorkerInfo("A", "prefill", "x", load={"running": True}),
    ],
    ids=["empty-id", "bad-role", "reserved-field", "bool-load"],
)
def test_register_rejects_invalid_workers(redis_url: str, worker: WorkerInfo) -> None:
    async def body() -> None:
        async with open_index(redis_url) as index:
            with pytest.raises(ValueError):
                await index.register(worker)
            assert await index.live_workers() == []

    asyncio.run(body())


def test_import_does_not_pull_torch() -> None:
    code = "import sys, pdserve.cluster.prefix_index; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _members(raw: redis.Redis, index: PrefixIndex) -> set[str]:
    """Every member of every block set of the index's model."""
    members: set[str] = set()
    for key in raw.scan_iter(index.key("block:*")):
        members.update(str(m) for m in raw.smembers(key))  # decoded replies
    return members


def test_a_worker_of_another_kv_format_is_refused_until_the_others_are_gone(
    redis_url: str,
) -> None:
    """Blocks cross only between workers of one KV format: while a live worker has
    "bfloat16/4", one with "fp8/4" is refused (nothing written, the error names both);
    once the first deregisters, the new format registers. An unchecked worker ("")
    never conflicts, and a worker may re-register under its own id."""

    async def body() -> None:
        async with open_index(redis_url) as index:
            bf16 = WorkerInfo("P", "prefill", "p:1", kv_format="bfloat16/4")
            fp8 = WorkerInfo("D", "decode", "d:1", kv_format="fp8/4")
            gen = await index.register(bf16)
            assert await index.register(bf16) > gen  # its own earlier registration: fine
            with pytest.raises(
                KVFormatMismatchError, match=r"'fp8/4'.*live worker P.*'bfloat16/4'"
            ):
                await index.register(fp8)
            assert [w.worker_id for w in await index.live_workers()] == ["P"]
            assert (await index.live_workers())[0].kv_format == "bfloat16/4"
            await index.register(WorkerInfo("X", "decode", "x:1"))  # unchecked
            assert await index.deregister("P")
            await index.register(fp8)
            formats = {w.worker_id: w.kv_format for w in await index.live_workers()}
            assert formats == {"D": "fp8/4", "X": ""}

    asyncio.run(body())
