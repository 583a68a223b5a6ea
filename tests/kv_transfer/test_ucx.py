"""UCX-specific behaviour the conformance suite does not pin down."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import resource
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from pdserve.kv_transfer.base import KVLayout, ReceiverConfig, make_header
from pdserve.kv_transfer.ucx_backend import CONTROL_BYTES, UcxReceiver, UcxSender

TOKEN = "test-cluster-token"
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextlib.asynccontextmanager
async def _pair(layout: KVLayout) -> AsyncIterator[tuple[UcxReceiver, UcxSender, str]]:
    """A started receiver and a sender, closed on the way out."""
    receiver = UcxReceiver(ReceiverConfig(cluster_token=TOKEN, layout=layout))
    sender = UcxSender()
    address = await receiver.start()
    try:
        yield receiver, sender, address
    finally:
        await sender.close()
        await receiver.close()


def test_idle_sender_and_receiver_use_no_cpu() -> None:
    """With a connection open and idle (the sender keeps it, the receiver waits on it for
    the next header), nothing spins: ucxx's own blocking mode burnt a whole core here."""
    payload = np.random.default_rng(0).integers(0, 256, 8 * LAYOUT.block_bytes, np.uint8)

    async def body() -> float:
        async with _pair(LAYOUT) as (receiver, sender, address):
            receiver.expect("req")
            header = make_header("req", "m", LAYOUT, payload, TOKEN)
            await sender.send(address, header, payload, timeout_s=30)
            (await receiver.claim("req", timeout_s=30)).release()
            before = _cpu_s()
            await asyncio.sleep(1.0)  # the window measured, not a synchronisation
            return _cpu_s() - before

    idle_cpu_s = asyncio.run(asyncio.wait_for(body(), 60))
    assert idle_cpu_s < 0.2, f"{idle_cpu_s:.2f} s of CPU in 1 s idle"


def test_a_header_larger_than_one_control_message_arrives_whole() -> None:
    """Thousands of blocks with their hashes make a header over CONTROL_BYTES: it spills
    into a second message, and the transfer still lands byte-exact."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=1, dtype="float32")
    num_blocks = 3000
    payload = np.random.default_rng(1).integers(0, 256, num_blocks * layout.block_bytes, np.uint8)
    hashes = tuple(i.to_bytes(32, "little") for i in range(num_blocks))

    async def body() -> None:
        async with _pair(layout) as (receiver, sender, address):
            receiver.expect("req")
            header = make_header("req", "m", layout, payload, TOKEN, block_hashes=hashes)
            assert header.to_proto().ByteSize() > CONTROL_BYTES
            await sender.send(address, header, payload, timeout_s=30)
            got = await receiver.claim("req", timeout_s=30)
            assert got.header.block_hashes == hashes
            assert np.array_equal(got.payload, payload)
            got.release()

    asyncio.run(asyncio.wait_for(body(), 60))


def _listening(port: int) -> set[str]:
    """The local addresses of the IPv4/IPv6 TCP sockets listening on `port` (from the
    kernel's socket tables, as `ss -ltn` reads them)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.split(":")
                if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(address)
                    if len(raw) == 4:
                        found.add(str(ipaddress.IPv4Address(raw[::-1])))
                    else:  # four little-endian 32-bit words
                        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                        found.add(str(ipaddress.IPv6Address(words)))
    return found


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_the_listener_binds_the_configured_address_only(host: str) -> None:
    """The receiver listens on `ReceiverConfig.host`, not on every interface (ucxx's own
    `create_listener` binds 0.0.0.0). 127.0.0.2 is a loopback address no other receiver
    uses, so a listener on all interfaces would show up as 0.0.0.0 there."""

    async def body() -> tuple[str, int, str]:
        receiver = UcxReceiver(ReceiverConfig(cluster_token=TOKEN, layout=LAYOUT, host=host))
        address = await receiver.start()
        try:
            port = int(address.rpartition(":")[2])
            return address, port, str(receiver._listener.ip)
        finally:
            sockets = _listening(int(address.rpartition(":")[2]))
            await receiver.close()
            assert sockets == {host}, sockets

    address, port, bound_ip = asyncio.run(asyncio.wait_for(body(), 60))
    assert address == f"{host}:{port}" and bound_ip == host
    assert _listening(port) == set()  # closed with the receiver
