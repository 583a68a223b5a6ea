"""gRPC-only behaviour: TLS, and the chunk codec against protobuf's own encoding."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pdserve.kv_transfer import grpc_codec
from pdserve.kv_transfer.base import KVLayout, ReceiverConfig, make_header
from pdserve.kv_transfer.errors import UnauthorizedError
from pdserve.kv_transfer.grpc_backend import GrpcReceiver, GrpcSender, TLSConfig
from pdserve.protos import kv_transfer_pb2 as pb

TOKEN = "grpc-test-token"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSConfig:
    """A self-signed cert for 127.0.0.1 and localhost; it is its own CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder: Path = tmp_path_factory.mktemp("tls")
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return TLSConfig(str(cert_file), str(key_file), ca_file=str(cert_file))


async def _push_over_tls(tls: TLSConfig, token: str) -> np.ndarray:
    """Push 3 MiB over TLS with `token`; return what the receiver claimed."""
    payload = np.random.default_rng(1).integers(0, 256, 96 * LAYOUT.block_bytes, dtype=np.uint8)
    receiver = GrpcReceiver(ReceiverConfig(cluster_token=TOKEN, layout=LAYOUT), tls=tls)
    sender = GrpcSender(tls=tls, chunk_bytes=1 << 20)
    address = await receiver.start()
    try:
        receiver.expect("req")
        header = make_header("req", "m", LAYOUT, payload, token)
        await sender.send(address, header, payload, timeout_s=30)
        got = await receiver.claim("req", timeout_s=30)
        assert np.array_equal(got.payload, payload)
        return got.payload
    finally:
        receiver.cancel("req")
        assert receiver.num_pending == 0
        await sender.close()
        await receiver.close()


def test_tls_round_trip(tls: TLSConfig) -> None:
    asyncio.run(asyncio.wait_for(_push_over_tls(tls, TOKEN), 60))


def test_tls_with_wrong_token_is_refused(tls: TLSConfig) -> None:
    with pytest.raises(UnauthorizedError):
        asyncio.run(asyncio.wait_for(_push_over_tls(tls, "not-the-token"), 60))


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
