"""Receive buffers are reused only once nobody can write or read them any more."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pdserve.kv_transfer.base import BufferPool, KVLayout, ReceiverConfig, make_header
from pdserve.kv_transfer.errors import TransferTimeoutError
from pdserve.kv_transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float16")


def test_pool_hands_back_views_of_released_buffers() -> None:
    pool = BufferPool(max_bytes=1 << 20)
    first = pool.take(1000)
    pool.give(first)
    again = pool.take(900)  # fits within 2x: a view of the same memory
    assert again.base is first.base or again.base is first
    assert again.size == 900
    assert pool.take(900).base is None  # the pooled one is taken: a fresh buffer
    pool.give(again)
    assert pool.take(100).base is None  # too small for the 1000-byte buffer (> 2x)


def test_released_payload_is_reused_and_unreleased_is_not() -> None:
    async def body() -> None:
        hub = LoopbackHub()
        receiver = LoopbackReceiver(hub, ReceiverConfig(cluster_token="t", layout=LAYOUT))
        sender = LoopbackSender(hub)
        address = await receiver.start()
        payload = np.arange(3 * LAYOUT.block_bytes, dtype=np.uint8)
        try:
            bases = []
            for i, release in enumerate([True, False, True]):
                receiver.expect(f"r{i}")
                header = make_header(f"r{i}", "m", LAYOUT, payload, "t")
                await sender.send(address, header, payload, timeout_s=5)
                got = await receiver.claim(f"r{i}", timeout_s=5)
                bases.append(got.payload.base if got.payload.base is not None else got.payload)
                assert np.array_equal(got.payload, payload)
                if release:
                    got.release()
            assert bases[1] is bases[0]  # r0 released: r1 reused its memory
            assert bases[2] is not bases[1]  # r1 kept by its caller: r2 got fresh memory
        finally:
            await receiver.close()

    asyncio.run(body())


def test_timed_out_claim_never_pools_a_buffer_still_being_written() -> None:
    async def body() -> None:
        hub = LoopbackHub()
        receiver = LoopbackReceiver(hub, ReceiverConfig(cluster_token="t", layout=LAYOUT))
        await receiver.start()
        payload = np.zeros(LAYOUT.block_bytes, dtype=np.uint8)
        try:
            receiver.expect("r")
            receiver.core.begin(make_header("r", "m", LAYOUT, payload, "t"))  # writer busy
            with pytest.raises(TransferTimeoutError):
                await receiver.claim("r", timeout_s=0.05)
            assert receiver.core.pool.num_free_bytes == 0
            assert receiver.num_pending == 0
        finally:
            await receiver.close()

    asyncio.run(body())
