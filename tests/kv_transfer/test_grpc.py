"""gRPC-only behaviour: TLS, and the chunk codec against protobuf's own encoding."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trustme

from pdserve.kv_transfer import grpc_codec
from pdserve.kv_transfer.base import KVLayout, ReceiverConfig, make_header
from pdserve.kv_transfer.errors import (
    PeerUnavailableError,
    TLSHandshakeError,
    UnauthorizedError,
)
from pdserve.kv_transfer.grpc_backend import GrpcReceiver, GrpcSender, TLSConfig
from pdserve.protos import kv_transfer_pb2 as pb

TOKEN = "grpc-test-token"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")


@dataclasses.dataclass(frozen=True)
class PKI:
    """The cluster's CA with a certificate for 127.0.0.1, and an unrelated CA with one."""

    tls: TLSConfig  # cluster cert/key, trusting the cluster CA
    foreign: TLSConfig  # a cert/key of the other CA, trusting the other CA
    foreign_cert_trusting_ours: TLSConfig  # the other CA's cert/key, trusting ours


def _write(ca: trustme.CA, folder: Path, name: str) -> tuple[str, str, str]:
    cert = ca.issue_cert("127.0.0.1", "localhost")  # an IP SAN and a DNS SAN
    paths = [folder / f"{name}-{what}.pem" for what in ("cert", "key", "ca")]
    cert.cert_chain_pems[0].write_to_path(str(paths[0]))
    cert.private_key_pem.write_to_path(str(paths[1]))
    ca.cert_pem.write_to_path(str(paths[2]))
    return str(paths[0]), str(paths[1]), str(paths[2])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    folder = tmp_path_factory.mktemp("tls")
    ours = _write(trustme.CA(), folder, "ours")
    theirs = _write(trustme.CA(), folder, "theirs")
    return PKI(
        TLSConfig(*ours),
        TLSConfig(*theirs),
        TLSConfig(theirs[0], theirs[1], ours[2]),
    )


@pytest.fixture(scope="module")
def tls(pki: PKI) -> TLSConfig:
    return pki.tls


class Tap:
    """A TCP relay to `target` that records every byte in both directions."""

    def __init__(self, target: str) -> None:
        self.host, _, port = target.rpartition(":")
        self.port = int(port)
        self.seen = bytearray()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await src.read(1 << 16):
                self.seen += data
                dst.write(data)
                await dst.drain()
        dst.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        try:
            yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        finally:
            server.close()


async def _push(
    receiver_tls: TLSConfig | None, sender_tls: TLSConfig | None, token: str = TOKEN
) -> tuple[bytes, int]:
    """Push 3 MiB through a Tap; return the bytes the wire carried and what the receiver
    buffered. Raises the sender's error after checking that nothing was received."""
    payload = np.random.default_rng(1).integers(0, 256, 96 * LAYOUT.block_bytes, dtype=np.uint8)
    receiver = GrpcReceiver(ReceiverConfig(cluster_token=TOKEN, layout=LAYOUT), tls=receiver_tls)
    sender = GrpcSender(tls=sender_tls, chunk_bytes=1 << 20)
    tap = Tap(await receiver.start())
    try:
        async with tap.running() as address:
            receiver.expect("req")
            header = make_header("req", "m", LAYOUT, payload, token)
            try:
                await sender.send(address, header, payload, timeout_s=30)
            except Exception:
                assert receiver.core.num_buffered_bytes == 0, "a refused push left bytes"
                raise
            got = await receiver.claim("req", timeout_s=30)
            assert np.array_equal(got.payload, payload)
            got.release()
            return bytes(tap.seen), int(payload.nbytes)
    finally:
        receiver.cancel("req")
        assert receiver.num_pending == 0
        await sender.close()
        await receiver.close()


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.mark.parametrize("mutual", [False, True], ids=["server-auth", "mutual"])
def test_tls_round_trip_carries_no_plaintext(pki: PKI, mutual: bool) -> None:
    """Over TLS the push lands whole, and neither the cluster token nor the payload's
    bytes appear on the wire."""
    server = dataclasses.replace(pki.tls, require_client_auth=mutual)
    wire, num_bytes = _run(_push(server, pki.tls))
    assert len(wire) > num_bytes  # all of it went through the tap
    assert TOKEN.encode() not in wire
    plain = np.random.default_rng(1).integers(0, 256, 96 * LAYOUT.block_bytes, dtype=np.uint8)
    assert plain[:64].tobytes() not in wire


def test_a_plaintext_sender_is_refused(pki: PKI) -> None:
    with pytest.raises(PeerUnavailableError):
        _run(_push(pki.tls, None))


def test_a_sender_trusting_another_ca_is_refused(pki: PKI) -> None:
    with pytest.raises(TLSHandshakeError):
        _run(_push(pki.tls, pki.foreign))


def test_mutual_tls_refuses_a_client_certificate_of_another_ca(pki: PKI) -> None:
    server = dataclasses.replace(pki.tls, require_client_auth=True)
    with pytest.raises(PeerUnavailableError):
        _run(_push(server, pki.foreign_cert_trusting_ours))


def test_a_tls_sender_never_falls_back_to_plaintext(pki: PKI) -> None:
    """A receiver without TLS (or anything else on its port) gets a handshake, never a
    header: the token does not cross the wire."""

    async def body() -> bytes:
        receiver = GrpcReceiver(ReceiverConfig(cluster_token=TOKEN, layout=LAYOUT))
        sender = GrpcSender(tls=pki.tls)
        tap = Tap(await receiver.start())
        payload = np.zeros(LAYOUT.block_bytes, np.uint8)
        try:
            async with tap.running() as address:
                receiver.expect("req")
                header = make_header("req", "m", LAYOUT, payload, TOKEN)
                with pytest.raises(TLSHandshakeError):
                    await sender.send(address, header, payload, timeout_s=10)
                assert receiver.core.num_buffered_bytes == 0
                return bytes(tap.seen)
        finally:
            receiver.cancel("req")
            await sender.close()
            await receiver.close()

    wire = _run(body())
    assert wire and TOKEN.encode() not in wire


def test_tls_with_wrong_token_is_refused(tls: TLSConfig) -> None:
    with pytest.raises(UnauthorizedError):
        _run(_push(tls, tls, "not-the-token"))


@pytest.mark.parametrize("offset", [0, 1, 300, 1 << 40])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 1 << 16])
def test_chunk_codec_matches_protobuf(offset: int, size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    ours = grpc_codec.encode_chunk(offset, memoryview(data))
    theirs = pb.TransferMessage(chunk=pb.Chunk(offset=offset, data=data)).SerializeToString()
    assert pb.TransferMessage.FromString(ours) == pb.TransferMessage.FromString(theirs)
    for raw in (ours, theirs):  # protobuf omits a zero offset; we always write it
        chunk = grpc_codec.decode(raw)
        assert isinstance(chunk, grpc_codec.Chunk)
        assert chunk.offset == offset and bytes(chunk.data) == data


class PushOnlyReceiver(GrpcReceiver):
    """A receiver from before `PushStream` (as during a rolling upgrade)."""

    def _method_handlers(self) -> dict[str, Any]:
        handlers = super()._method_handlers()
        del handlers["PushStream"]
        return handlers


def _payload(num_blocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, num_blocks * LAYOUT.block_bytes, dtype=np.uint8)


async def _push_and_claim(
    sender: GrpcSender, receiver: GrpcReceiver, address: str, request_id: str, seed: int
) -> None:
    payload = _payload(64, seed)
    receiver.expect(request_id)
    header = make_header(request_id, "m", LAYOUT, payload, TOKEN)
    await sender.send(address, header, payload, timeout_s=30)
    got = await receiver.claim(request_id, timeout_s=30)
    assert np.array_equal(got.payload, payload)
    got.release()


def test_a_receiver_without_push_stream_gets_plain_pushes() -> None:
    """The sender falls back to one `Push` call per push, and stays with it."""

    async def body() -> None:
        receiver = PushOnlyReceiver(ReceiverConfig(cluster_token=TOKEN, layout=LAYOUT))
        sender = GrpcSender()
        address = await receiver.start()
        try:
            for i in range(2):
                await _push_and_claim(sender, receiver, address, f"req-{i}", seed=i)
            assert address in sender._legacy and not sender._idle.get(address)
            payload = _payload(8, seed=3)  # a refusal comes back typed on `Push` too
            header = make_header("req-2", "m", LAYOUT, payload, "not-the-token")
            with pytest.raises(UnauthorizedError):
                await sender.send(address, header, payload, timeout_s=30)
            assert receiver.num_pending == 0
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_pushes_share_one_call_and_survive_a_receiver_restart() -> None:
    """Pushes reuse one idle `PushStream` call; when the receiver restarts on the same
    port, the call it dropped is not reused: the push goes through on a fresh one."""

    async def body() -> None:
        config = ReceiverConfig(cluster_token=TOKEN, layout=LAYOUT)
        receiver = GrpcReceiver(config)
        sender = GrpcSender()
        address = await receiver.start()
        try:
            await _push_and_claim(sender, receiver, address, "req-0", seed=0)
            (call,) = sender._idle[address]
            await _push_and_claim(sender, receiver, address, "req-1", seed=1)
            assert sender._idle[address] == [call]  # the same call carried both
            await receiver.close()
            port = int(address.rpartition(":")[2])
            receiver = GrpcReceiver(dataclasses.replace(config, port=port))
            assert await receiver.start() == address
            await _push_and_claim(sender, receiver, address, "req-2", seed=2)
            assert sender._idle[address] != [call]
            assert receiver.num_pending == 0
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(asyncio.wait_for(body(), 60))
