"""gRPC transport: pushes of one header then payload chunks, on `KVTransfer.PushStream`.

The receiver is a `grpc.aio` server on the decode worker's event loop, serving:
- `PushStream`: a long-lived bidirectional call carrying pushes one after another, an
  ack for each. A sender keeps up to `MAX_IDLE_STREAMS` idle calls per receiver and
  takes one per push, so concurrent pushes run on calls of their own. This saves a
  call's set-up per push (a 1 MiB push: ~1.7 ms on `Push`, ~1 ms here).
- `Push`: one push per call, for senders from before `PushStream`. A sender falls back
  to it when a receiver answers UNIMPLEMENTED (a pool upgraded before the other).

The sender keeps one channel per receiver address. Chunks skip protobuf's copies
(`grpc_codec`), and the receiver copies each straight into the buffer
`ReceiverCore.begin` hands out and hashes its slabs while they are in cache, so a chunk
is copied once into gRPC, once or twice inside it, and once into place; grpcio's own
copies bound the throughput (~2.2 GB/s on a 2-core host, against ~5 for raw TCP).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from pdserve.kv_transfer import grpc_codec
from pdserve.kv_transfer.base import (
    BlockHasher,
    KVReceiver,
    KVSender,
    Payload,
    ReceiverConfig,
    ReceiverCore,
    TransferHeader,
    TransferStats,
    as_bytes,
)
from pdserve.kv_transfer.errors import (
    BadHeaderError,
    PeerUnavailableError,
    TLSHandshakeError,
    TransferError,
    TransferTimeoutError,
    TruncatedError,
    ack_for,
    error_from_ack,
)
from pdserve.kv_transfer.tls import TLSConfig
from pdserve.protos import kv_transfer_pb2 as pb

__all__ = ["GrpcReceiver", "GrpcSender", "TLSConfig"]

_SERVICE = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name
_PUSH = f"/{_SERVICE}/Push"
_PUSH_STREAM = f"/{_SERVICE}/PushStream"
# how grpcio's details name a failed TLS handshake (a certificate the CA did not sign,
# a wrong name, a missing client certificate); a plaintext peer only shows "Socket closed"
_TLS_FAILURE = re.compile(r"handshake|SSL_ERROR|CERTIFICATE_VERIFY", re.IGNORECASE)
MAX_IDLE_STREAMS = 4  # idle PushStream calls a sender keeps per receiver
# acks after which the receiver ends a PushStream call (it cannot tell where the next
# push starts); after any other, the call carries the next push
_OUT_OF_STEP = (pb.BAD_HEADER, pb.TRUNCATED, pb.INTERNAL)
MAX_MESSAGE_BYTES = 64 << 20  # a chunk, or a header (8 bytes of checksum per block)
# NOTE: grpcio copies each received message through a growing bytearray, and large
# ones fault in fresh pages on every copy, so chunks stay small (docs/measurements.md).
DEFAULT_CHUNK_BYTES = 1 << 20
_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.max_frame_size", (1 << 24) - 1),  # the largest HTTP/2 allows
    ("grpc.http2.bdp_probe", 1),  # grow the flow-control window to the link
]
_CLIENT_OPTIONS: list[tuple[str, Any]] = [
    *_OPTIONS,
    ("grpc.use_local_subchannel_pool", 1),  # one connection per sender and address
    ("grpc.initial_reconnect_backoff_ms", 200),  # a restarted decode worker is back soon
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class GrpcReceiver(KVReceiver):
    def __init__(self, config: ReceiverConfig, tls: TLSConfig | None = None) -> None:
        self.core = ReceiverCore(config)
        self.tls = tls
        self._server: Any = None

    async def start(self) -> str:
        server = grpc.aio.server(options=[*_OPTIONS, ("grpc.so_reuseport", 0)])
        handlers = grpc.method_handlers_generic_handler(_SERVICE, self._method_handlers())
        server.add_generic_rpc_handlers((handlers,))
        bind = f"{self.core.config.host}:{self.core.config.port}"
        if self.tls is None:
            port = server.add_insecure_port(bind)
        else:
            port = server.add_secure_port(bind, self.tls.server_credentials())
        if not port:
            raise OSError(f"gRPC receiver cannot bind {bind}")
        await server.start()
        self._server = server
        return f"{self.core.config.host}:{port}"

    def _method_handlers(self) -> dict[str, Any]:
        codec: dict[str, Any] = {
            "request_deserializer": grpc_codec.decode,
            "response_serializer": pb.TransferAck.SerializeToString,
        }
        return {
            "Push": grpc.stream_unary_rpc_method_handler(self._push, **codec),
            "PushStream": grpc.stream_stream_rpc_method_handler(self._push_stream, **codec),
        }

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=0.2)
        self.core.cancel_all()

    async def _push(
        self, messages: AsyncIterator[grpc_codec.Message], context: Any
    ) -> pb.TransferAck:
        """`Push`: one push on the call; the ack is the response."""
        stream = aiter(messages)
        ack, _ = await self._receive(await anext(stream, None), stream, drain=False)
        return ack

    async def _push_stream(
        self, messages: AsyncIterator[grpc_codec.Message], context: Any
    ) -> AsyncIterator[pb.TransferAck]:
        """`PushStream`: pushes one after another, an ack for each, until the sender
        closes the call or a message out of place ends it."""
        stream = aiter(messages)
        while (first := await anext(stream, None)) is not None:
            ack, in_step = await self._receive(first, stream, drain=True)
            yield ack
            if not in_step:
                return

    async def _receive(
        self, first: grpc_codec.Message, stream: AsyncIterator[grpc_codec.Message], drain: bool
    ) -> tuple[pb.TransferAck, bool]:
        """One push: `first` must be its header, and exactly its payload's bytes follow
        on `stream`. Returns the ack (the core's verdict) and whether the stream is still
        in step (at the next push's header). With `drain`, a refused push's chunks are
        read and dropped so that it stays in step."""
        if not isinstance(first, pb.TransferHeader):
            return ack_for(BadHeaderError("a push must start with a header")), False
        try:
            header = TransferHeader.from_proto(first)
        except TransferError as exc:  # how many chunks follow is unknown
            return ack_for(exc), False
        lease_s = min(header.lease_ms / 1000, self.core.config.max_lease_s)
        try:
            buffer = self.core.begin(header)
        except TransferError as exc:  # refused: nothing is held
            return ack_for(exc), drain and await _skip(stream, header.payload_bytes, lease_s)
        progress = _Progress(buffer, BlockHasher(header.layout, header.num_blocks))
        try:
            await progress.fill(stream, lease_s)
            if not drain and await anext(stream, None) is not None:
                raise BadHeaderError("a message follows the payload")
            self.core.finish(header, progress.received, progress.checksums())
        except TransferError as exc:
            self.core.fail(header, exc)  # no-op when finish already failed it
            # in step if the payload was read whole (a bad checksum, a cancelled request)
            whole = progress.received == buffer.size and not isinstance(exc, BadHeaderError)
            return ack_for(exc, progress.received), whole
        except BaseException:  # cancelled: the sender went away or the server stops
            why = f"stream broke after {progress.received} of {buffer.size} bytes"
            self.core.fail(header, TruncatedError(why))
            raise
        return ack_for(None, progress.received), True


async def _skip(stream: AsyncIterator[grpc_codec.Message], num_bytes: int, lease_s: float) -> bool:
    """Read and drop `num_bytes` of chunks (a refused push's) within the lease; False if
    the stream broke, ended or held anything else first."""
    skipped = 0
    try:
        async with asyncio.timeout(lease_s):
            while skipped < num_bytes:
                msg = await anext(stream, None)
                if not isinstance(msg, grpc_codec.Chunk) or msg.offset != skipped:
                    return False
                skipped += len(msg.data)
    except TimeoutError:
        return False
    return skipped == num_bytes


@dataclass
class _Progress:
    """Where the chunks of one push are going, and how far they got.

    Each chunk's whole slabs are hashed right after it is copied in (from cache), so
    verification is done when the last chunk is in.
    """

    buffer: np.ndarray
    hasher: BlockHasher
    received: int = 0

    def checksums(self) -> tuple[int, ...] | None:
        """The block checksums, or None if the payload is incomplete (finish says so)."""
        if self.received != self.buffer.size:
            return None
        self.hasher.update(self.buffer, self.hasher.num_rows)  # no-op unless 0 bytes
        return self.hasher.checksums()

    async def fill(self, stream: AsyncIterator[grpc_codec.Message], lease_s: float) -> None:
        """Copy the payload's chunks, which must arrive in order, into the buffer within
        the lease; stop once it is whole, or when the stream ends."""
        try:
            async with asyncio.timeout(lease_s):  # past the lease the core freed the buffer
                while self.received < self.buffer.size:
                    msg = await anext(stream, None)
                    if msg is None:
                        return  # ended early: finish reports the truncation
                    self._put(msg)
        except TimeoutError:
            raise TruncatedError(f"{self.received} bytes arrived within the lease") from None

    def _put(self, msg: grpc_codec.Message) -> None:
        if not isinstance(msg, grpc_codec.Chunk):
            raise BadHeaderError("only chunks may follow the header")
        start, end = self.received, self.received + len(msg.data)
        if msg.offset != start or end > self.buffer.size:
            raise BadHeaderError(
                f"chunk at {msg.offset} (+{len(msg.data)}) does not follow byte {start} "
                f"of {self.buffer.size}"
            )
        self.buffer[start:end] = np.frombuffer(msg.data, dtype=np.uint8)
        self.received = end
        self.hasher.update_bytes(self.buffer, end)  # its slabs, while still in cache


class _Unimplemented(Exception):
    """The receiver predates `PushStream` (a rolling upgrade): push with `Push`."""


def _rejected_stream(exc: grpc.aio.AioRpcError, streamed_before: bool) -> bool:
    """Whether a failed `PushStream` call means the receiver lacks the method.

    It answers UNIMPLEMENTED, but when it rejects the call while chunks are still being
    written, gRPC's core ends the call with INTERNAL ("Internal error from Core")
    instead (seen in about one push in four). So INTERNAL from a receiver that never
    acked a `PushStream` push also tries `Push`; the address is marked legacy only if
    that works, and a real failure there raises its own typed error.
    """
    code = exc.code()
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return True
    return code == grpc.StatusCode.INTERNAL and not streamed_before


class GrpcSender(KVSender):
    """Pushes on long-lived `PushStream` calls, one push at a time per call, with a few
    idle calls kept per receiver (like connections in a pool); falls back to one `Push`
    call per push for a receiver that does not serve `PushStream`."""

    def __init__(self, tls: TLSConfig | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES - 64:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_MESSAGE_BYTES - 64}]")
        self.tls = tls
        self.chunk_bytes = chunk_bytes
        self._channels: dict[str, Any] = {}
        self._idle: dict[str, list[Any]] = {}  # address -> idle PushStream calls
        self._legacy: set[str] = set()  # addresses whose receiver has only Push
        self._streaming: set[str] = set()  # addresses that have acked on PushStream

    async def send(
        self, address: str, header: TransferHeader, payload: Payload, timeout_s: float
    ) -> TransferStats:
        start = time.monotonic()
        data = as_bytes(payload)
        if data.size != header.payload_bytes:
            raise TruncatedError(f"payload has {data.size} bytes, header {header.payload_bytes}")
        ack: pb.TransferAck | None = None
        legacy = False
        if address not in self._legacy:
            try:
                ack = await self._push_on_stream(address, header, data, timeout_s)
                self._streaming.add(address)
            except _Unimplemented:
                legacy = True
        if ack is None:
            left_s = max(0.0, timeout_s - (time.monotonic() - start))
            ack = await self._push_once(address, header, data, left_s)
            if legacy:  # `Push` works there: it stays the way to this receiver
                self._legacy.add(address)
        error = error_from_ack(ack)
        if error is not None:
            raise error
        return TransferStats(
            header.request_id, ack.bytes_received, header.num_blocks, time.monotonic() - start
        )

    async def _push_on_stream(
        self, address: str, header: TransferHeader, data: np.ndarray, timeout_s: float
    ) -> pb.TransferAck:
        """One push on an idle call (or a new one); the call goes back to the pool only
        if the receiver stays in step on it."""
        deadline = time.monotonic() + timeout_s
        call, reused = self._take(address)
        try:
            try:
                ack = await self._push_on(call, header, data, deadline)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                if not reused:
                    raise
                # an idle call the receiver has since dropped (it restarted, say):
                # nothing of this push was taken, so it goes again on a fresh call
                call.cancel()
                call, _ = self._take(address, fresh=True)
                ack = await self._push_on(call, header, data, deadline)
        except TimeoutError:
            call.cancel()
            raise TransferTimeoutError(f"push to {address} took over {timeout_s}s") from None
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            if _rejected_stream(exc, address in self._streaming):
                raise _Unimplemented from None
            raise _typed(exc, address) from None
        except BaseException:
            call.cancel()
            raise
        if ack.code in _OUT_OF_STEP:  # the receiver ended the call after this ack
            call.cancel()
        else:
            self._release(address, call)
        return ack

    async def _push_on(
        self, call: Any, header: TransferHeader, data: np.ndarray, deadline: float
    ) -> pb.TransferAck:
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            try:
                for message in _messages(header, data.data, self.chunk_bytes):
                    await call.write(message)
            except asyncio.InvalidStateError:
                pass  # the receiver ended the call early: its last ack says why
            ack = await call.read()
        if ack is grpc.aio.EOF:
            code = await call.code()
            if code != grpc.StatusCode.OK:
                raise grpc.aio.AioRpcError(
                    code, grpc.aio.Metadata(), grpc.aio.Metadata(), await call.details()
                )
            raise TransferError("the receiver ended the push stream without an ack")
        assert isinstance(ack, pb.TransferAck)
        return ack

    async def _push_once(
        self, address: str, header: TransferHeader, data: np.ndarray, timeout_s: float
    ) -> pb.TransferAck:
        """One push on a `Push` call of its own."""
        push = self._channel(address).stream_unary(
            _PUSH, request_serializer=None, response_deserializer=pb.TransferAck.FromString
        )

        async def messages() -> AsyncIterator[bytes]:
            for message in _messages(header, data.data, self.chunk_bytes):
                yield message

        try:
            # NOTE: the deadline bounds the RPC; wait_for bounds everything around it too.
            ack = await asyncio.wait_for(push(messages(), timeout=timeout_s), timeout_s)
        except TimeoutError:
            raise TransferTimeoutError(f"push to {address} took over {timeout_s}s") from None
        except grpc.aio.AioRpcError as exc:
            raise _typed(exc, address) from None
        assert isinstance(ack, pb.TransferAck)
        return ack

    def _take(self, address: str, fresh: bool = False) -> tuple[Any, bool]:
        """An idle call to `address` and True, or a new one and False."""
        idle = self._idle.get(address, [])
        while idle and not fresh:
            call = idle.pop()
            if not call.done():
                return call, True
        open_stream = self._channel(address).stream_stream(
            _PUSH_STREAM, request_serializer=None, response_deserializer=pb.TransferAck.FromString
        )
        return open_stream(), False

    def _release(self, address: str, call: Any) -> None:
        idle = self._idle.setdefault(address, [])
        if call.done() or len(idle) >= MAX_IDLE_STREAMS or address not in self._channels:
            call.cancel()
        else:
            idle.append(call)

    async def close(self) -> None:
        for calls in self._idle.values():
            for call in calls:
                call.cancel()
        self._idle.clear()
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    def _channel(self, address: str) -> Any:
        channel = self._channels.get(address)
        if channel is None:
            if self.tls is None:
                channel = grpc.aio.insecure_channel(address, options=_CLIENT_OPTIONS)
            else:
                options = list(_CLIENT_OPTIONS)
                if self.tls.server_name:
                    options.append(("grpc.ssl_target_name_override", self.tls.server_name))
                creds = self.tls.channel_credentials()
                channel = grpc.aio.secure_channel(address, creds, options=options)
            self._channels[address] = channel
        return channel


def _messages(header: TransferHeader, data: memoryview, chunk_bytes: int) -> Iterator[bytes]:
    yield grpc_codec.encode_header(header.to_proto())
    for offset in range(0, len(data), chunk_bytes):
        yield grpc_codec.encode_chunk(offset, data[offset : offset + chunk_bytes])


def _typed(exc: grpc.aio.AioRpcError, address: str) -> TransferError:
    code, detail = exc.code(), f"push to {address}: {exc.code().name} {exc.details()}"
    if _TLS_FAILURE.search(exc.details() or ""):
        return TLSHandshakeError(detail)
    if code == grpc.StatusCode.UNAVAILABLE:
        return PeerUnavailableError(detail)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransferTimeoutError(detail)
    return TransferError(detail)
