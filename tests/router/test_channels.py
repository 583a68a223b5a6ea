"""Token channels, both ends in one event loop: batching, breaks, idle ends, aborts.

The router's `DecodeChannels`/`ChannelStream` talk to the decode side's `Channels`
through a stand-in for a Ray Serve handle (the calls run in this loop instead of a
replica's); the cluster tests run the same code through Serve.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from pdserve.decode_worker.channels import Batch, Channels
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.channels import ChannelError, ChannelStream, DecodeChannels

TIMEOUT_S = 10.0


class FakeDecode:
    """A decode replica's channel calls; `emit` plays an engine step."""

    def __init__(self, worker_id: str = "d0", idle_s: float = 60.0) -> None:
        self.worker_id = worker_id
        self.idle_s = idle_s
        self.channels = Channels()
        self.batches_sent: list[Batch] = []
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.running: dict[str, asyncio.Queue[dict[str, Any]]] = {}

    async def channel(
        self, channel_id: str, target_replica: str | None = None
    ) -> AsyncIterator[Batch]:
        hello = {"type": "channel", "worker_id": self.worker_id}
        async for batch in self.channels.serve(channel_id, hello, self.idle_s):
            if batch[0][0]:  # not the hello
                self.batches_sent.append(batch)
            yield batch

    async def submit(
        self, channel_id: str, request_id: str, *args: Any, worker_id: str | None = None, **kw: Any
    ) -> dict[str, Any]:
        channel = self.channels.get(channel_id)
        if channel is None or (worker_id is not None and worker_id != self.worker_id):
            return {"type": "no_channel", "worker_id": self.worker_id}
        self.submitted.append(request_id)
        items: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.running[request_id] = items

        async def run() -> None:
            try:
                while True:
                    item = await items.get()
                    channel.put(request_id, item)
                    if item.get("finished") or item.get("type") == "error":
                        return
            finally:
                channel.tasks.pop(request_id, None)
                self.running.pop(request_id, None)

        channel.tasks[request_id] = asyncio.create_task(run())
        return {"type": "accepted", "worker_id": self.worker_id, "kv_expected": False}

    async def abort(self, channel_id: str, request_id: str, **kw: Any) -> bool:
        self.aborted.append(request_id)
        channel = self.channels.get(channel_id)
        task = channel.tasks.get(request_id) if channel is not None else None
        if task is not None:
            task.cancel()
        return task is not None

    def emit(self, request_id: str, token: int, finished: bool = False) -> None:
        self.running[request_id].put_nowait(
            {"type": "output", "token_ids": [token], "finished": finished}
        )


class _Stream:
    """A Serve streaming response over an async generator run in this loop."""

    def __init__(self, agen: AsyncIterator[Any], broken: asyncio.Event) -> None:
        self._agen = agen
        self._broken = broken
        self._pending: asyncio.Future[Any] | None = None
        self._closing: asyncio.Future[Any] | None = None

    async def __anext__(self) -> Any:
        nxt = self._pending = asyncio.ensure_future(self._agen.__anext__())
        broke = asyncio.ensure_future(self._broken.wait())
        done, _ = await asyncio.wait({nxt, broke}, return_when=asyncio.FIRST_COMPLETED)
        if nxt in done:
            broke.cancel()
            return nxt.result()
        nxt.cancel()
        raise ConnectionError("the replica died")

    def cancel(self) -> None:
        """As Serve cancels the replica's call: the generator stops where it waits."""
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()
        else:
            self._closing = asyncio.ensure_future(self._agen.aclose())  # type: ignore[attr-defined]


class _Call:
    def __init__(self, handle: FakeHandle, name: str) -> None:
        self._handle, self._name = handle, name

    def remote(self, *args: Any, target_replica: str | None = None, **kw: Any) -> Any:
        handle = self._handle
        replica = handle.route(target_replica)
        fn = getattr(replica, self._name)
        if self._name == "channel":
            handle.opened += 1
            return _Stream(fn(*args, target_replica=target_replica, **kw), handle.broken)
        return asyncio.ensure_future(fn(*args, **kw))


class FakeHandle:
    """A decode deployment handle: a call goes to its target replica if that one lives."""

    def __init__(self, *replicas: FakeDecode) -> None:
        self.replicas = {r.worker_id: r for r in replicas}
        self.broken = asyncio.Event()
        self.opened = 0
        self.spread = 0

    def route(self, target: str | None) -> FakeDecode:
        if target in self.replicas:
            return self.replicas[target]
        self.spread += 1  # no target: Serve spreads calls over the replicas
        return list(self.replicas.values())[self.spread % len(self.replicas)]

    def options(self, stream: bool = False) -> FakeHandle:
        return self

    def __getattr__(self, name: str) -> _Call:
        return _Call(self, name)


def _stream(channels: DecodeChannels, request_id: str, target: str | None = "d0") -> ChannelStream:
    return ChannelStream(channels, request_id, target, [1, 2, 3], SamplingParams(), False, None)


async def _next(stream: ChannelStream) -> dict[str, Any]:
    async with asyncio.timeout(TIMEOUT_S):
        return await stream.__anext__()


def in_loop(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run an async test body in a fresh event loop (the suite has no async plugin)."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@in_loop
async def test_one_message_carries_every_request_of_a_step() -> None:
    decode = FakeDecode()
    handle = FakeHandle(decode)
    channels = DecodeChannels(handle, TIMEOUT_S)
    a, b = _stream(channels, "a"), _stream(channels, "b")
    assert (await _next(a))["type"] == "accepted"
    assert (await _next(b))["type"] == "accepted"
    assert handle.opened == 1, "both requests must share one channel"
    for step in range(3):
        decode.emit("a", 10 + step, finished=step == 2)
        decode.emit("b", 20 + step)
        got_a, got_b = await _next(a), await _next(b)
        assert (got_a["token_ids"], got_b["token_ids"]) == ([10 + step], [20 + step])
    assert [len(batch) for batch in decode.batches_sent] == [2, 2, 2]
    b.cancel()
    await _settle()
    assert decode.aborted == ["b"], "a finished stream is not aborted; an unfinished one is"
    channels.close()


@in_loop
async def test_a_broken_channel_fails_every_request_on_it() -> None:
    decode = FakeDecode()
    handle = FakeHandle(decode)
    channels = DecodeChannels(handle, TIMEOUT_S)
    streams = [_stream(channels, rid) for rid in ("a", "b")]
    for s in streams:
        await _next(s)
    handle.broken.set()
    for s in streams:
        with pytest.raises(ChannelError, match="decode worker failed"):
            await _next(s)
    assert channels.num_open == 0
    channels.close()


@in_loop
async def test_an_idle_channel_ends_and_the_next_request_opens_another() -> None:
    decode = FakeDecode(idle_s=0.05)
    handle = FakeHandle(decode)
    channels = DecodeChannels(handle, TIMEOUT_S)
    first = _stream(channels, "a")
    await _next(first)
    decode.emit("a", 1, finished=True)
    assert (await _next(first))["finished"]
    async with asyncio.timeout(TIMEOUT_S):
        while channels.num_open:  # the decode side ends it after idle_s without requests
            await asyncio.sleep(0.01)
    second = _stream(channels, "b")
    assert (await _next(second))["type"] == "accepted"
    assert handle.opened == 2
    decode.emit("b", 2, finished=True)
    assert (await _next(second))["token_ids"] == [2]
    channels.close()


@in_loop
async def test_a_submit_that_finds_no_channel_is_made_again_on_a_new_one() -> None:
    decode = FakeDecode()
    handle = FakeHandle(decode)
    channels = DecodeChannels(handle, TIMEOUT_S)
    await _next(_stream(channels, "a"))
    (conn,) = channels._conns.values()
    # the decode side lost the channel (as after an idle end the router has not seen yet)
    decode.channels._open.pop(conn.channel_id).close()
    s = _stream(channels, "b")
    assert (await _next(s))["type"] == "accepted"
    assert handle.opened == 2 and decode.submitted == ["a", "b"]
    decode.emit("b", 5, finished=True)
    assert (await _next(s))["token_ids"] == [5]
    channels.close()


@in_loop
async def test_an_error_item_fails_only_its_request() -> None:
    decode = FakeDecode()
    channels = DecodeChannels(FakeHandle(decode), TIMEOUT_S)
    a, b = _stream(channels, "a"), _stream(channels, "b")
    await _next(a)
    await _next(b)
    decode.running["a"].put_nowait({"type": "error", "message": "boom"})
    decode.emit("b", 7, finished=True)
    with pytest.raises(ChannelError, match="boom"):
        await _next(a)
    assert (await _next(b))["token_ids"] == [7]
    channels.close()


@in_loop
async def test_closing_a_channel_aborts_its_requests_on_the_decode_side() -> None:
    decode = FakeDecode()
    channels = DecodeChannels(FakeHandle(decode), TIMEOUT_S)
    await _next(_stream(channels, "a"))
    assert decode.channels.num_requests == 1
    channels.close()  # the router replica goes away
    async with asyncio.timeout(TIMEOUT_S):
        while decode.channels.num_requests:
            await asyncio.sleep(0.01)


@in_loop
async def test_without_a_target_serve_picks_the_replica_of_each_request() -> None:
    """Placement without the index: requests spread as Serve spreads them, and the
    channel to each replica is shared by the requests that land there."""
    d0, d1 = FakeDecode("d0"), FakeDecode("d1")
    handle = FakeHandle(d0, d1)
    channels = DecodeChannels(handle, TIMEOUT_S)
    streams = [_stream(channels, rid, target=None) for rid in ("a", "b", "c", "d")]
    workers = [(await _next(s))["worker_id"] for s in streams]
    assert sorted(workers) == ["d0", "d0", "d1", "d1"]
    assert channels.num_open == 2 and sorted(d0.submitted + d1.submitted) == list("abcd")
    for s, rid, worker in zip(streams, "abcd", workers, strict=True):
        (d0 if worker == "d0" else d1).emit(rid, 1, finished=True)
        assert (await _next(s))["token_ids"] == [1]
    channels.close()


class _Stopped(RuntimeError):
    pass


@in_loop
async def test_stopped_channels_fail_every_request_and_take_no_more() -> None:
    """The cluster stops (router/draining.py): every waiting request gets its own error,
    the channels close (the decode replica's calls end) and a new request is refused."""
    decode = FakeDecode()
    handle = FakeHandle(decode)
    channels = DecodeChannels(handle, TIMEOUT_S)
    streams = [_stream(channels, rid) for rid in ("a", "b")]
    for s in streams:
        await _next(s)
    channels.stop(lambda: _Stopped("the server is shutting down"))
    errors = []
    for s in streams:
        with pytest.raises(_Stopped) as caught:
            await _next(s)
        errors.append(caught.value)
    assert errors[0] is not errors[1], "each request raises an error of its own"
    await _settle()
    assert channels.num_open == 0
    assert decode.running == {}, "the closed channel ended the requests on the replica"
    with pytest.raises(_Stopped):
        await _next(_stream(channels, "c"))
    assert decode.submitted == ["a", "b"]
