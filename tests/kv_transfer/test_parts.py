"""KV heads in parts (tensor parallelism): one request's KV as several transfers.

A decode rank owning KV heads [a, b) gets one part per prefill rank holding some of
them; the claim returns once the verified parts tile [a, b), and any part failing
fails the request and frees every part. Each transport test runs on every backend.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from pdserve.kv_transfer.base import (
    HeadRange,
    KVLayout,
    ReceiverConfig,
    TransferHeader,
    make_header,
)
from pdserve.kv_transfer.errors import (
    BadHeaderError,
    ChecksumMismatchError,
    DuplicateTransferError,
    KVMismatchError,
    LayoutMismatchError,
    TruncatedError,
    UnknownRequestError,
)
from pdserve.kv_transfer.loopback import LoopbackHub, LoopbackReceiver
from pdserve.kv_transfer.torch_payload import part_layout, payload_tensor, received_tensors
from pdserve.protos import kv_transfer_pb2 as pb

CHAIN = tuple(bytes([i]) * 32 for i in range(1, 4))  # the prompt's 3 full blocks' hashes
HALVES: list[HeadRange] = [(0, 1), (1, 2)]


def random_payload(layout: KVLayout, num_blocks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, num_blocks * layout.block_bytes, dtype=np.uint8)


def split_heads(full: np.ndarray, layout: KVLayout, ranges: list[HeadRange]) -> list[np.ndarray]:
    """The payloads of `ranges` (indices into `layout`'s heads) of a whole payload: what
    each prefill rank packs of its own heads, [layers, 2, n, heads, block_size, head_dim]."""
    num_blocks = full.size // layout.block_bytes
    shaped = full.reshape(layout.num_layers, 2, num_blocks, layout.num_kv_heads, -1)
    return [np.ascontiguousarray(shaped[:, :, :, a:b]).reshape(-1) for a, b in ranges]


def part_header(
    transport: Any, layout: KVLayout, heads: HeadRange, payload: np.ndarray, **kwargs: Any
) -> TransferHeader:
    """The header of part `heads` of request "req"; `layout` is the whole KV's."""
    kwargs.setdefault("first_token", 7)
    return make_header(
        *("req", kwargs.pop("model_id", "m"), part_layout(layout, heads), payload),
        transport.token,
        kv_heads=heads,
        **kwargs,
    )


def test_two_parts_from_two_senders_make_one_claim(transport: Any) -> None:
    layout = transport.layout()  # the receiver owns both heads
    full = random_payload(layout, 3)
    parts = split_heads(full, layout, HALVES)

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        senders = [transport.make_sender() for _ in HALVES]
        address = await receiver.start()
        try:
            receiver.expect("req", model_id="m", block_hashes=CHAIN)  # checked per part
            headers = [
                part_header(transport, layout, heads, p, block_hashes=CHAIN)
                for heads, p in zip(HALVES, parts, strict=True)
            ]
            sent = await asyncio.gather(
                *(
                    sender.send(address, h, p, timeout_s=30)
                    for sender, h, p in zip(senders, headers, parts, strict=True)
                )
            )
            assert [s.num_bytes for s in sent] == [p.size for p in parts]
            got = await receiver.claim("req", timeout_s=30)
            assert [p.kv_heads for p in got.parts] == HALVES
            for part, header, payload in zip(got.parts, headers, parts, strict=True):
                assert part.header == header
                assert np.array_equal(part.payload, payload)
            assert got.header == headers[0] and got.header.first_token == 7
            assert got.stats.num_bytes == full.size and got.stats.num_blocks == 3
            with pytest.raises(ValueError, match=r"2 parts \(KV heads \[0, 1\), \[1, 2\)\)"):
                _ = got.payload  # no one part is the request's KV
            # side by side on the head axis, the parts are the whole KV
            whole = torch.cat([t for _, t in received_tensors(got)], dim=3)
            assert whole.shape == payload_tensor(full, layout).shape
            assert np.array_equal(whole.contiguous().view(torch.uint8).numpy().ravel(), full)
            assert receiver.num_pending == 0 and receiver.core.num_buffered_bytes == 0
            free = receiver.core.pool.num_free_bytes
            got.release()  # every part's buffer goes back
            assert receiver.core.pool.num_free_bytes == free + full.size
        finally:
            for sender in senders:
                await sender.close()
            await receiver.close()

    transport.run(body())


def test_a_receiver_takes_only_its_own_kv_heads(transport: Any) -> None:
    whole = transport.layout()
    layout = part_layout(whole, (1, 2))  # a decode rank owning head 1 of 2
    payload = random_payload(layout, 2)

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout, kv_heads=(1, 2)))
        sender = transport.make_sender()
        address = await receiver.start()
        try:
            receiver.expect("req")
            for heads in ((0, 1), None):  # None: heads [0, 1) of a 1-head layout
                header = make_header("req", "m", layout, payload, transport.token, kv_heads=heads)
                match = r"KV heads \[0, 1\) are not this receiver's \[1, 2\)"
                with pytest.raises(LayoutMismatchError, match=match):
                    await sender.send(address, header, payload, timeout_s=30)
            both = random_payload(whole, 2)
            header = make_header("req", "m", whole, both, transport.token, kv_heads=(0, 2))
            with pytest.raises(LayoutMismatchError, match=r"\[0, 2\) are not"):
                await sender.send(address, header, both, timeout_s=30)
            assert receiver.core.num_buffered_bytes == 0
            # the refusals left the expectation alone: its own part still lands
            header = make_header("req", "m", layout, payload, transport.token, kv_heads=(1, 2))
            await sender.send(address, header, payload, timeout_s=30)
            got = await receiver.claim("req", timeout_s=30)
            (part,) = got.parts
            assert part.kv_heads == (1, 2) and got.header.kv_heads == (1, 2)
            assert part.payload is got.payload and np.array_equal(got.payload, payload)
            got.release()
            assert receiver.num_pending == 0
        finally:
            await sender.close()
            await receiver.close()

    transport.run(body())


def test_a_part_overlapping_one_that_began_is_refused(transport: Any) -> None:
    layout = transport.layout()
    low, high = split_heads(random_payload(layout, 2), layout, HALVES)
    other = random_payload(part_layout(layout, (0, 1)), 2, seed=9)
    both = random_payload(layout, 2, seed=8)

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        sender = transport.make_sender()
        address = await receiver.start()
        try:
            receiver.expect("req")
            await sender.send(address, part_header(transport, layout, (0, 1), low), low, 30)
            for heads, payload in (((0, 1), other), ((0, 2), both)):
                header = part_header(transport, layout, heads, payload)
                with pytest.raises(DuplicateTransferError, match=r"heads \[0, 1\)"):
                    await sender.send(address, header, payload, timeout_s=30)
            assert receiver.core.num_buffered_bytes == low.size  # the request goes on
            await sender.send(address, part_header(transport, layout, (1, 2), high), high, 30)
            got = await receiver.claim("req", timeout_s=30)
            assert [p.kv_heads for p in got.parts] == HALVES
            assert np.array_equal(got.parts[0].payload, low)  # the first, not the duplicate
            assert np.array_equal(got.parts[1].payload, high)
            got.release()
            assert receiver.num_pending == 0
        finally:
            await sender.close()
            await receiver.close()

    transport.run(body())


@pytest.mark.parametrize(
    "field",
    ["first_token", "first_token_logprob", "num_blocks", "first_block_index", "block_hashes"],
)
def test_parts_that_disagree_fail_the_request(transport: Any, field: str) -> None:
    """Parts of one request are one prefill's blocks and first token: a part that says
    otherwise than an earlier one means the KV cannot be assembled."""
    layout = transport.layout()
    low, high = split_heads(random_payload(layout, 2), layout, HALVES)
    shared: dict[str, Any] = dict(first_token=7, first_token_logprob=-0.25, block_hashes=CHAIN[:2])
    differs: dict[str, Any] = dict(shared)
    if field == "first_token":
        differs["first_token"] = 8
    if field == "first_token_logprob":
        differs["first_token_logprob"] = -0.5
    if field == "num_blocks":
        high = split_heads(random_payload(layout, 3), layout, HALVES)[1]
    if field == "first_block_index":
        differs["first_block_index"] = 1
    if field == "block_hashes":
        differs["block_hashes"] = (CHAIN[0], b"\xff" * 32)

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        sender = transport.make_sender()
        address = await receiver.start()
        try:
            receiver.expect("req")
            header = part_header(transport, layout, (0, 1), low, **shared)
            await sender.send(address, header, low, timeout_s=30)
            header = part_header(transport, layout, (1, 2), high, **differs)
            with pytest.raises(KVMismatchError, match=f"differs from part \\[0, 1\\) in {field}"):
                await sender.send(address, header, high, timeout_s=30)
            assert receiver.core.num_buffered_bytes == 0  # the first part is freed too
            with pytest.raises(KVMismatchError):  # at once: the request's KV will not come
                await receiver.claim("req", timeout_s=5)
            assert receiver.num_pending == 0
        finally:
            await sender.close()
            await receiver.close()

    transport.run(body())


def test_a_corrupted_part_fails_the_request_and_frees_every_part(transport: Any) -> None:
    layout = transport.layout()
    low, high = split_heads(random_payload(layout, 2), layout, HALVES)

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        sender = transport.make_sender()
        address = await receiver.start()
        try:
            receiver.expect("req")
            await sender.send(address, part_header(transport, layout, (0, 1), low), low, 30)
            header = part_header(transport, layout, (1, 2), high)
            bad = high.copy()
            bad[bad.size // 2] ^= 0xFF  # after the checksums
            with pytest.raises(ChecksumMismatchError):
                await sender.send(address, header, bad, timeout_s=30)
            assert receiver.core.num_buffered_bytes == 0
            # both writers were done: both buffers are back in the pool
            assert receiver.core.pool.num_free_bytes == low.size + high.size
            with pytest.raises(ChecksumMismatchError):
                await receiver.claim("req", timeout_s=5)
            assert receiver.num_pending == 0
        finally:
            await sender.close()
            await receiver.close()

    transport.run(body())


def test_a_request_missing_a_part_at_lease_end_fails_and_frees_it(transport: Any) -> None:
    layout = transport.layout()
    low, high = split_heads(random_payload(layout, 2), layout, HALVES)

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        sender = transport.make_sender()
        address = await receiver.start()
        core = receiver.core
        lease_ended = asyncio.Event()
        core.on_lease_end = lambda request_id: lease_ended.set()
        try:
            receiver.expect("req")
            header = part_header(transport, layout, (0, 1), low, lease_ms=100)
            await sender.send(address, header, low, timeout_s=30)
            assert core.num_buffered_bytes == low.size
            await asyncio.wait_for(lease_ended.wait(), timeout=10)
            assert core.num_buffered_bytes == 0
            assert core.pool.num_free_bytes == low.size  # verified: its buffer is reused
            # the request failed: its other part is late
            with pytest.raises(UnknownRequestError):
                await sender.send(address, part_header(transport, layout, (1, 2), high), high, 30)
            with pytest.raises(TruncatedError, match=r"incomplete at lease end.*\[0, 1\)"):
                await receiver.claim("req", timeout_s=5)
            assert receiver.num_pending == 0
        finally:
            await sender.close()
            await receiver.close()

    transport.run(body())


# -- the receiver core's bookkeeping, driven directly (no transport) ---------------------

LAYOUT = KVLayout(num_layers=2, num_kv_heads=3, head_dim=16, block_size=4, dtype="float16")


def _core_header(heads: HeadRange, payload: np.ndarray) -> TransferHeader:
    return make_header("req", "m", part_layout(LAYOUT, heads), payload, "t", kv_heads=heads)


def test_failing_a_request_by_id_frees_every_part_and_pools_only_finished_writers() -> None:
    async def body() -> None:
        receiver = LoopbackReceiver(LoopbackHub(), ReceiverConfig("t", LAYOUT))
        await receiver.start()
        core = receiver.core
        one, two = part_layout(LAYOUT, (0, 1)), part_layout(LAYOUT, (1, 3))
        a, b = np.full(2 * one.block_bytes, 1, np.uint8), np.full(2 * two.block_bytes, 2, np.uint8)
        c = np.zeros(2 * one.block_bytes, np.uint8)
        try:
            receiver.expect("req")
            ha, hb = _core_header((0, 1), a), _core_header((1, 3), b)
            core.begin(ha)[:] = a
            core.finish(ha, a.size)
            core.begin(hb)  # its writer is still busy
            with pytest.raises(DuplicateTransferError, match=r"\[1, 3\) for 'req'"):
                core.begin(_core_header((2, 3), c))  # inside the part in flight
            assert core.num_buffered_bytes == a.size + b.size
            core.fail("req", TruncatedError("the decode side gave up"))  # by id
            assert core.num_buffered_bytes == 0
            assert core.pool.num_free_bytes == a.size  # b may still be written: dropped
            with pytest.raises(UnknownRequestError, match=r"\[1, 3\)"):
                core.finish(hb, b.size)  # its writer reports late
            core.fail(hb, TruncatedError("late"))  # no-op
            with pytest.raises(TruncatedError, match="gave up"):
                await receiver.claim("req", timeout_s=1)
            assert receiver.num_pending == 0 and core.pool.num_free_bytes == a.size
        finally:
            await receiver.close()

    asyncio.run(body())


def test_parts_of_uneven_widths_tile_the_range_in_any_order() -> None:
    async def body() -> None:
        receiver = LoopbackReceiver(LoopbackHub(), ReceiverConfig("t", LAYOUT))
        await receiver.start()
        core = receiver.core
        full = random_payload(LAYOUT, 2)
        ranges: list[HeadRange] = [(1, 3), (0, 1)]  # arriving high part first
        payloads = split_heads(full, LAYOUT, ranges)
        try:
            receiver.expect("req")
            for heads, payload in zip(ranges, payloads, strict=True):
                header = _core_header(heads, payload)  # begins: the request is not complete
                core.begin(header)[:] = payload
                core.finish(header, payload.size)
            got = await receiver.claim("req", timeout_s=10)
            assert [p.kv_heads for p in got.parts] == [(0, 1), (1, 3)]
            assert [p.header.layout.num_kv_heads for p in got.parts] == [1, 2]
            assert got.header.kv_heads == (0, 1)
            assert np.array_equal(got.parts[0].payload, payloads[1])
            assert np.array_equal(got.parts[1].payload, payloads[0])
            got.release()
        finally:
            await receiver.close()

    asyncio.run(body())


# -- the header and the config -----------------------------------------------------------


def test_a_header_without_kv_heads_is_what_it_was_on_the_wire() -> None:
    payload = random_payload(LAYOUT, 1)
    plain = make_header("req", "m", LAYOUT, payload, "t")
    assert plain.kv_heads is None and plain.head_range == (0, 3)
    msg = plain.to_proto()
    names = {f.name for f, _ in msg.ListFields()}
    assert not names & {"kv_head_start", "kv_head_end"}  # absent: the bytes are as before
    assert TransferHeader.from_proto(pb.TransferHeader.FromString(msg.SerializeToString()))
    assert TransferHeader.from_proto(msg) == plain


def test_a_part_header_crosses_the_wire_and_a_bad_range_is_refused() -> None:
    layout = part_layout(LAYOUT, (1, 3))
    part = make_header("req", "m", layout, random_payload(layout, 2), "t", kv_heads=(1, 3))
    msg = pb.TransferHeader.FromString(part.to_proto().SerializeToString())
    assert (msg.kv_head_start, msg.kv_head_end) == (1, 3)
    assert TransferHeader.from_proto(msg) == part and part.head_range == (1, 3)
    for start, end in ((0, 1), (1, 4), (2, 0), (3, 1)):  # other width; start >= end
        msg.kv_head_start, msg.kv_head_end = start, end
        with pytest.raises(BadHeaderError, match="KV heads"):
            TransferHeader.from_proto(msg)
    with pytest.raises(ValueError, match="KV heads"):
        dataclasses.replace(part, kv_heads=(0, 1))
    with pytest.raises(ValueError, match="KV heads"):
        ReceiverConfig("t", layout, kv_heads=(0, 3))
    assert ReceiverConfig("t", layout, kv_heads=(1, 3)).head_range == (1, 3)
    with pytest.raises(ValueError, match="no range"):
        part_layout(LAYOUT, (2, 2))
