"""gRPC transport: `KVTransfer.Push`, a client stream of one header then payload chunks.

The receiver is a `grpc.aio` server on the decode worker's event loop; the sender keeps
one channel per receiver address. Chunks skip protobuf's copies (`grpc_codec`), and the
receiver copies each straight into the buffer `ReceiverCore.begin` hands out, so a chunk
is copied once into gRPC, once out of it, and once into place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
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
    TransferError,
    TransferTimeoutError,
    TruncatedError,
    ack_for,
    error_from_ack,
)
from pdserve.protos import kv_transfer_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name
_PUSH = f"/{_SERVICE}/Push"
MAX_MESSAGE_BYTES = 64 << 20  # a chunk, or a header (8 bytes of checksum per block)
# NOTE: measured on 127.0.0.1: 0.5-1 MiB chunks move ~1.5x the bytes/s of 4 MiB ones;
# grpcio copies each received message through a growing bytearray, and large ones fault
# in fresh pages on every copy.
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


@dataclass(frozen=True)
class TLSConfig:
    """PEM files. The server presents cert/key; the client trusts `ca_file` and presents
    cert/key as its own (the server checks it only with `require_client_auth`)."""

    cert_file: str
    key_file: str
    ca_file: str
    require_client_auth: bool = False
    server_name: str | None = None  # the name the server cert holds, if not the host

    def server_credentials(self) -> Any:
        return grpc.ssl_server_credentials(
            [(_read(self.key_file), _read(self.cert_file))],
            root_certificates=_read(self.ca_file),
            require_client_auth=self.require_client_auth,
        )

    def channel_credentials(self) -> Any:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


class GrpcReceiver(KVReceiver):
    def __init__(self, config: ReceiverConfig, tls: TLSConfig | None = None) -> None:
        self.core = ReceiverCore(config)
        self.tls = tls
        self._server: Any = None

    async def start(self) -> str:
        server = grpc.aio.server(options=[*_OPTIONS, ("grpc.so_reuseport", 0)])
        handler = grpc.stream_unary_rpc_method_handler(
            self._push,
            request_deserializer=grpc_codec.decode,
            response_serializer=pb.TransferAck.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, {"Push": handler}),)
        )
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

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=0.2)
        self.core.cancel_all()

    async def _push(
        self, messages: AsyncIterator[grpc_codec.Message], context: Any
    ) -> pb.TransferAck:
        """One push: a header, then chunks in order; the ack is the core's verdict."""
        first = await anext(aiter(messages), None)
        if not isinstance(first, pb.TransferHeader):
            return ack_for(BadHeaderError("a push must start with a header"))
        try:
            header = TransferHeader.from_proto(first)
            buffer = self.core.begin(header)
        except TransferError as exc:  # refused: nothing is held
            return ack_for(exc)
        progress = _Progress(buffer, BlockHasher(header.layout, header.num_blocks))
        try:
            await progress.fill(messages, min(header.lease_ms / 1000, self.core.config.max_lease_s))
            self.core.finish(header.request_id, progress.received, progress.checksums())
        except TransferError as exc:
            self.core.fail(header.request_id, exc)  # no-op when finish already failed it
            return ack_for(exc, progress.received)
        except BaseException:  # cancelled: the sender went away or the server stops
            why = f"stream broke after {progress.received} of {buffer.size} bytes"
            self.core.fail(header.request_id, TruncatedError(why))
            raise
        return ack_for(None, progress.received)


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

    async def fill(self, messages: AsyncIterator[grpc_codec.Message], lease_s: float) -> None:
        """Copy chunks, which must arrive in order, into the buffer within the lease."""
        try:
            async with asyncio.timeout(lease_s):  # past the lease the core freed the buffer
                async for msg in messages:
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


class GrpcSender(KVSender):
    def __init__(self, tls: TLSConfig | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES - 64:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_MESSAGE_BYTES - 64}]")
        self.tls = tls
        self.chunk_bytes = chunk_bytes
        self._channels: dict[str, Any] = {}

    async def send(
        self, address: str, header: TransferHeader, payload: Payload, timeout_s: float
    ) -> TransferStats:
        start = time.monotonic()
        data = as_bytes(payload)
        if data.size != header.payload_bytes:
            raise TruncatedError(f"payload has {data.size} bytes, header {header.payload_bytes}")
        push = self._channel(address).stream_unary(
            _PUSH, request_serializer=None, response_deserializer=pb.TransferAck.FromString
        )
        messages = _messages(header, data.data, self.chunk_bytes)
        try:
            # NOTE: the deadline bounds the RPC; wait_for bounds everything around it too.
            ack = await asyncio.wait_for(push(messages, timeout=timeout_s), timeout_s)
        except TimeoutError:
            raise TransferTimeoutError(f"push to {address} took over {timeout_s}s") from None
        except grpc.aio.AioRpcError as exc:
            raise _typed(exc, address) from None
        error = error_from_ack(ack)
        if error is not None:
            raise error
        return TransferStats(
            header.request_id, ack.bytes_received, header.num_blocks, time.monotonic() - start
        )

    async def close(self) -> None:
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


async def _messages(
    header: TransferHeader, data: memoryview, chunk_bytes: int
) -> AsyncIterator[bytes]:
    yield grpc_codec.encode_header(header.to_proto())
    for offset in range(0, len(data), chunk_bytes):
        yield grpc_codec.encode_chunk(offset, data[offset : offset + chunk_bytes])


def _typed(exc: grpc.aio.AioRpcError, address: str) -> TransferError:
    code, detail = exc.code(), f"push to {address}: {exc.code().name} {exc.details()}"
    if code == grpc.StatusCode.UNAVAILABLE:
        return PeerUnavailableError(detail)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransferTimeoutError(detail)
    return TransferError(detail)
