"""A worker's index membership against a real redis-server: register, publish, recover."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as aioredis

from pdserve.cluster.drain import DrainNotices
from pdserve.cluster.prefix_index import KVFormatMismatchError, PrefixIndex, WorkerInfo
from pdserve.common.hashing import BlockHash, hash_block_chain, hash_namespace
from pdserve.common.kv_events import KVEvent, KVEventKind
from pdserve.deploy.redis_server import free_port
from pdserve.runtime.index_member import IndexMember, LastKnownLoad

MODEL = "demo-model"
CHAIN = hash_block_chain(list(range(40)), 4, hash_namespace(MODEL))


class FakeWorker:
    """What the member reads from a worker: a block pool's events and its contents."""

    def __init__(self) -> None:
        self.cached: list[BlockHash] = []
        self.events: list[KVEvent] = []

    def store(self, n: int) -> None:
        new = CHAIN[len(self.cached) : len(self.cached) + n]
        self.cached += new
        self.events.append(KVEvent(KVEventKind.STORED, tuple(new)))

    async def load(self) -> dict[str, int]:
        return {"running": 0, "kv_blocks_used": len(self.cached)}

    async def drain(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    async def snapshot(self) -> list[KVEvent]:
        self.events = []
        return [KVEvent(KVEventKind.STORED, tuple(self.cached))] if self.cached else []


def member(index: PrefixIndex, worker: FakeWorker, heartbeat_s: float = 60.0) -> IndexMember:
    return IndexMember(
        index,
        "w1",
        "decode",
        "127.0.0.1:9",
        worker.load,
        worker.drain,
        worker.snapshot,
        heartbeat_s,
    )


async def matched(index: PrefixIndex) -> int:
    """Blocks of CHAIN the index credits to w1; -1 when w1 is not live."""
    result = (await index.match(CHAIN)).get("w1")
    return -1 if result is None else result.matched_blocks


def test_flush_publishes_events_and_a_lost_registration_is_rebuilt(redis_url: str) -> None:
    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        index = PrefixIndex(client, MODEL, lease_s=30.0)
        worker = FakeWorker()
        worker.store(3)
        m = member(index, worker)
        await m.start()
        try:
            assert m.generation is not None and await matched(index) == 3  # snapshot
            worker.store(4)
            await m.flush()
            assert await matched(index) == 7
            # The registration is lost (expired in a stall, or Redis was flushed).
            await client.flushall()
            assert await matched(index) == -1
            worker.store(1)
            await m.flush()  # publish is refused: register again and republish all
            assert await matched(index) == 8
            assert m.num_registrations == 2
        finally:
            await m.stop()
        assert await matched(index) == -1, "stop() leaves the index"
        await client.aclose()

    asyncio.run(run())


def test_heartbeats_keep_the_lease_alive(redis_url: str) -> None:
    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        index = PrefixIndex(client, MODEL, lease_s=0.5)
        m = member(index, FakeWorker(), heartbeat_s=0.1)
        await m.start()
        try:
            generation = m.generation
            await asyncio.sleep(1.5)  # three leases long: only heartbeats keep it alive
            assert "w1" in await index.match(CHAIN)
            assert m.generation == generation, "never had to register again"
        finally:
            await m.stop()
            await client.aclose()

    asyncio.run(run())


class LongStep:
    """A worker whose engine thread is inside one step until `end()`: a load read waits
    for it, as the engine's command queue makes it wait."""

    def __init__(self) -> None:
        self.step_done = asyncio.Event()
        self.reads = 0
        self.step_s = 1.0  # what busy_s reports

    async def load(self) -> dict[str, int]:
        self.reads += 1
        await self.step_done.wait()
        return {"queued_prompt_tokens": 100 * self.reads}

    def busy_s(self) -> float:
        return self.step_s


def test_a_load_read_during_a_long_step_answers_the_last_known_load() -> None:
    async def run() -> None:
        worker = LongStep()
        worker.step_done.set()
        load = LastKnownLoad(worker.load, wait_s=0.05, busy_s=worker.busy_s, stuck_s=60.0)
        assert await load() == {"queued_prompt_tokens": 100}
        worker.step_done.clear()  # a long step begins
        assert await load() == {"queued_prompt_tokens": 100}  # within wait_s: the last
        assert await load() == {"queued_prompt_tokens": 100}
        assert (worker.reads, load.num_stale) == (2, 2), "one read outstanding, not one a tick"
        worker.step_done.set()  # the step ends: the outstanding read answers
        assert await load() == {"queued_prompt_tokens": 200}
        # stuck past stuck_s: the read is waited for (the lease lapses meanwhile)
        worker.step_done.clear()
        worker.step_s = 61.0
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(load(), 0.3)
        # nothing known yet: waited for too
        fresh = LastKnownLoad(worker.load, wait_s=0.05, busy_s=lambda: 0.0, stuck_s=60.0)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(fresh(), 0.3)

    asyncio.run(run())


def test_a_step_longer_than_the_lease_keeps_the_worker_placed(redis_url: str) -> None:
    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        index = PrefixIndex(client, MODEL, lease_s=0.5)
        blocks = FakeWorker()
        worker = LongStep()
        worker.step_done.set()
        load = LastKnownLoad(worker.load, wait_s=0.05, busy_s=worker.busy_s, stuck_s=60.0)
        m = IndexMember(
            index, "w1", "prefill", "", load, blocks.drain, blocks.snapshot, heartbeat_s=0.1
        )
        await m.start()
        try:
            generation = m.generation
            worker.step_done.clear()  # one step, three leases long
            await asyncio.sleep(1.5)
            assert "w1" in await index.match(CHAIN), "a long step is not a dead worker"
            assert m.generation == generation and load.num_stale > 0
            worker.step_s = 61.0  # now it counts as stuck: no heartbeat, the lease lapses
            await asyncio.sleep(1.5)
            assert "w1" not in await index.match(CHAIN)
            worker.step_done.set()
        finally:
            await m.stop()
            await client.aclose()

    asyncio.run(run())


def test_redis_down_is_logged_and_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        client = aioredis.Redis.from_url(
            f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5
        )
        m = member(PrefixIndex(client, MODEL), FakeWorker())
        await m.start()  # no Redis: the worker must still come up
        assert m.generation is None
        with caplog.at_level(logging.WARNING):
            await m.flush()
        await m.stop()
        await client.aclose()

    asyncio.run(run())
    assert "unreachable" in caplog.text


def test_a_member_of_another_kv_format_fails_to_start_and_is_never_placed(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose KV format differs from a live worker's fails at start (the replica
    does not come up); one refused later (re-registering after its lease lapsed while a
    worker of another format joined) logs an error each tick and stays out of placement."""

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        index = PrefixIndex(client, MODEL, lease_s=30.0)
        try:
            await index.register(WorkerInfo("w0", "prefill", "p:1", kv_format="int8/4"))
            worker = FakeWorker()
            refused = IndexMember(
                index, "w1", "decode", "d:1", worker.load, worker.drain, worker.snapshot,
                0.05, kv_format="bfloat16/4",
            )  # fmt: skip
            with pytest.raises(KVFormatMismatchError, match="same KV cache dtype"):
                await refused.start()
            assert await matched(index) == -1 and refused.generation is None
            # a member that registered first, then lost its lease to a format change
            late = IndexMember(
                index, "w1", "decode", "d:1", worker.load, worker.drain, worker.snapshot,
                0.05, kv_format="int8/4",
            )  # fmt: skip
            await late.start()
            assert await matched(index) == 0
            late.kv_format = "bfloat16/4"  # as if restarted with another format
            assert await index.deregister("w1")
            with caplog.at_level(logging.ERROR, logger="pdserve.runtime.index_member"):
                async with asyncio.timeout(10):
                    while "not placed" not in caplog.text:
                        await asyncio.sleep(0.05)
            assert await matched(index) == -1
            await late.stop()
        finally:
            await client.aclose()

    asyncio.run(run())


def test_stop_ends_the_heartbeat_even_when_its_cancel_is_lost(redis_url: str) -> None:
    """A cancellation can be lost inside a library (redis-py cleaning up a connection
    under its own timeout): stop() still ends the heartbeat task and leaves the index.
    Before the stop flag, stop() waited on the task forever."""

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        index = PrefixIndex(client, MODEL, lease_s=30.0)
        worker = FakeWorker()
        armed, inside, lost = False, asyncio.Event(), asyncio.Event()

        async def load() -> dict[str, int]:
            if armed and not lost.is_set():
                inside.set()
                try:
                    await asyncio.sleep(30)  # stop() cancels the heartbeat here
                except asyncio.CancelledError:
                    lost.set()  # ... and the cancel goes no further
            return await worker.load()

        m = IndexMember(index, "w1", "decode", "d:1", load, worker.drain, worker.snapshot, 0.05)
        await m.start()
        try:
            assert await matched(index) == 0
            armed = True
            async with asyncio.timeout(10):
                await inside.wait()
            # a task of its own, not cancelled by the bound: the old stop() swallowed that
            stopper = asyncio.create_task(m.stop())
            done, _ = await asyncio.wait({stopper}, timeout=10)
            assert stopper in done, "stop() is still waiting for the heartbeat task"
            assert lost.is_set() and await matched(index) == -1
        finally:
            await client.aclose()

    asyncio.run(run())


def test_a_drain_notice_takes_the_worker_out_of_the_index_for_good(redis_url: str) -> None:
    """A router announced that the worker leaves its pool (cluster/drain.py): at its next
    heartbeat it deregisters, calls `on_drain` with the deadline once, and neither a
    heartbeat nor a flush registers it again."""

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        index = PrefixIndex(client, MODEL, lease_s=30.0)
        notices = DrainNotices(client, MODEL)
        worker = FakeWorker()
        worker.store(3)
        drained: asyncio.Queue[float] = asyncio.Queue()
        m = IndexMember(
            index, "w1", "decode", "127.0.0.1:9", worker.load, worker.drain,
            worker.snapshot, 0.05,
            drain_deadline=lambda: notices.deadline("w1"), on_drain=drained.put_nowait,
        )  # fmt: skip
        await m.start()
        try:
            assert await matched(index) == 3
            assert await notices.announce("w1", 20.0)
            assert not await notices.announce("w1", 1.0)  # the first deadline holds
            deadline = await asyncio.wait_for(drained.get(), 10)
            assert deadline == await notices.deadline("w1")
            assert await matched(index) == -1 and m.generation is None
            worker.store(2)
            await m.flush()
            assert await matched(index) == -1 and m.generation is None
            assert drained.empty()
            assert await notices.deadline("w2") is None
        finally:
            await m.stop()
            await client.aclose()

    asyncio.run(run())
