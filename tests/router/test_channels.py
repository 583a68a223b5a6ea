"""Token channels, both ends in one event loop: batching, breaks, idle ends, aborts.

The router's `DecodeChannels`/`ChannelStream` talk to the decode side's `Channels`
through a stand-in for a Ray Serve handle (the calls run in this loop instead of a
replica's); the cluster tests run the same code through Serve.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.router.channels import ChannelError, ChannelStream, DecodeChannels
from tests.router.fakes import TIMEOUT_S, FakeDecode, FakeHandle, in_loop


def _stream(channels: DecodeChannels, request_id: str, target: str | None = "d0") -> ChannelStream:
    return ChannelStream(channels, request_id, target, [1, 2, 3], SamplingParams(), False, None)


async def _next(stream: ChannelStream) -> dict[str, Any]:
    async with asyncio.timeout(TIMEOUT_S):
        return await stream.__anext__()


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
