"""Decode side of the token channels: one stream per router connection, all its requests.

A router replica opens one channel (a long-lived Ray Serve streaming call) to each decode
replica it uses and submits requests with a plain call naming the channel. Every output
of those requests goes back on the channel, and everything that is ready when the channel
wakes goes as one message: after an engine step that produced a token for each of 64
streams, the router receives one message, not 64. The per-message cost of a Serve stream
(serialization, gRPC framing, a task wake-up at both ends) is paid per step instead of per
token, which is where the serving path spent most of its CPU under many streams.

A channel ends when its router goes away (the router's stream is cancelled: every request
it carried is aborted) or when it has carried no request for `idle_s` (so that Serve,
which waits for a draining replica's calls to end, can stop the replica; the router opens
a new one when it next needs it). Framework-free: the deployment wraps it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pdserve.cluster.messages import ChannelHello, StreamItem

# (request id, item) pairs; a channel's first batch is [("", hello)]
Batch = list[tuple[str, StreamItem | ChannelHello]]


class Channel:
    """One router connection's pending outputs and running requests."""

    def __init__(self, channel_id: str) -> None:
        self.channel_id = channel_id
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._items: Batch = []
        self._ready = asyncio.Event()
        self.open = True

    def put(self, request_id: str, item: StreamItem) -> None:
        self._items.append((request_id, item))
        self._ready.set()

    async def batches(self, idle_s: float) -> AsyncIterator[Batch]:
        """Yield what is pending, one batch per wake-up, until idle with nothing running."""
        while self.open:
            if not self._items:
                self._ready.clear()
                try:
                    async with asyncio.timeout(idle_s):
                        await self._ready.wait()
                except TimeoutError:
                    if not self.tasks and not self._items:
                        return
                    continue
            batch, self._items = self._items, []
            yield batch

    def close(self) -> None:
        """Stop taking requests and abort the running ones (the router is gone)."""
        self.open = False
        self._ready.set()
        for task in self.tasks.values():
            task.cancel()


class Channels:
    """Every open channel of a decode replica, by the id its router gave it."""

    def __init__(self) -> None:
        self._open: dict[str, Channel] = {}

    def get(self, channel_id: str) -> Channel | None:
        channel = self._open.get(channel_id)
        return channel if channel is not None and channel.open else None

    async def serve(
        self, channel_id: str, hello: ChannelHello, idle_s: float
    ) -> AsyncIterator[Batch]:
        """The channel's stream: `hello` first (which replica took it), then batches."""
        if channel_id in self._open:
            raise ValueError(f"channel {channel_id} is open already")
        channel = self._open[channel_id] = Channel(channel_id)
        try:
            yield [("", hello)]
            async for batch in channel.batches(idle_s):
                yield batch
        finally:
            self._open.pop(channel_id, None)
            channel.close()  # its requests' engine streams end and free their blocks

    def open_channels(self) -> list[Channel]:
        return list(self._open.values())

    @property
    def num_requests(self) -> int:
        return sum(len(c.tasks) for c in self._open.values())
