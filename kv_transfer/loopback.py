"""In-process transport: for tests and the colocated path, where P and D share a process.

A `LoopbackHub` stands in for the network: receivers register under a name, senders
look them up. The bytes are still copied into the receiver's own buffer and verified,
so the loopback path has the same semantics (and passes the same suite) as the others.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from pdserve.kv_transfer.base import (
    KVReceiver,
    KVSender,
    Payload,
    ReceiverConfig,
    ReceiverCore,
    TransferHeader,
    TransferStats,
    as_bytes,
)
from pdserve.kv_transfer.errors import PeerUnavailableError, TransferTimeoutError


class LoopbackHub:
    """The 'network' of one process: address -> receiver."""

    def __init__(self) -> None:
        self.receivers: dict[str, LoopbackReceiver] = {}
        self._ids = itertools.count()

    def new_address(self) -> str:
        return f"loopback:{next(self._ids)}"


class LoopbackReceiver(KVReceiver):
    def __init__(self, hub: LoopbackHub, config: ReceiverConfig) -> None:
        self.hub = hub
        self.core = ReceiverCore(config)
        self.address: str | None = None

    async def start(self) -> str:
        self.address = self.hub.new_address()
        self.hub.receivers[self.address] = self
        return self.address

    async def close(self) -> None:
        if self.address is not None:
            self.hub.receivers.pop(self.address, None)
            self.address = None
        self.core.cancel_all()


class LoopbackSender(KVSender):
    def __init__(self, hub: LoopbackHub) -> None:
        self.hub = hub

    async def send(
        self, address: str, header: TransferHeader, payload: Payload, timeout_s: float
    ) -> TransferStats:
        receiver = self.hub.receivers.get(address)
        if receiver is None:
            raise PeerUnavailableError(f"no receiver at {address}")
        try:
            return await asyncio.wait_for(self._push(receiver, header, payload), timeout_s)
        except TimeoutError:
            raise TransferTimeoutError(f"push to {address} took over {timeout_s}s") from None

    @staticmethod
    async def _push(
        receiver: LoopbackReceiver, header: TransferHeader, payload: Payload
    ) -> TransferStats:
        start = time.monotonic()
        core = receiver.core
        buffer = core.begin(header)
        data = as_bytes(payload)
        num_bytes = min(data.size, buffer.size)
        buffer[:num_bytes] = data[:num_bytes]
        stats = core.finish(header, data.size)  # raises the receiver's verdict
        return TransferStats(
            header.request_id, stats.num_bytes, stats.num_blocks, time.monotonic() - start
        )

    async def close(self) -> None:
        return None
