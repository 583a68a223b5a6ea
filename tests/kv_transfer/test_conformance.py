"""One conformance suite for every KV transport (loopback, gRPC, UCX).

Each test ends with nothing pending on the receiver and every endpoint closed.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import numpy as np
import pytest

from pdserve.kv_transfer.base import KVLayout, TransferHeader, make_header
from pdserve.kv_transfer.errors import (
    ChecksumMismatchError,
    KVMismatchError,
    LayoutMismatchError,
    LeaseExpiredError,
    PeerUnavailableError,
    TransferError,
    TransferTimeoutError,
    UnauthorizedError,
    UnknownRequestError,
)


def random_payload(layout: KVLayout, num_blocks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, num_blocks * layout.block_bytes, dtype=np.uint8)


_SIZES = {"1block": 1, "1MiB": 1 << 20, "64MiB": 64 << 20}
# every size for the model dtypes; the 8-bit formats (rows of head_dim + 2 bytes) once each
_ROUND_TRIPS = [(d, n) for n in _SIZES for d in ("float32", "float16", "bfloat16")]
_ROUND_TRIPS += [("int8", "1MiB"), ("fp8", "1block")]


@pytest.mark.parametrize(("dtype", "size"), _ROUND_TRIPS, ids=[f"{n}-{d}" for d, n in _ROUND_TRIPS])
def test_round_trip_is_byte_exact(transport: Any, dtype: str, size: str) -> None:
    num_bytes = _SIZES[size]
    layout = transport.layout(dtype)
    num_blocks = max(1, num_bytes // layout.block_bytes)
    payload = random_payload(layout, num_blocks)

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        sender = transport.make_sender()
        address = await receiver.start()
        try:
            receiver.expect("req-1")
            header = make_header("req-1", "m", layout, payload, transport.token, first_token=42)
            stats = await sender.send(address, header, payload, timeout_s=30)
            got = await receiver.claim("req-1", timeout_s=30)
            assert stats.num_bytes == payload.size and stats.num_blocks == num_blocks
            assert got.header.first_token == 42 and got.header.num_blocks == num_blocks
            assert np.array_equal(got.payload, payload)
            assert receiver.num_pending == 0
        finally:
            await sender.close()
            await receiver.close()

    transport.run(body())


def test_sixteen_concurrent_transfers_into_one_receiver(transport: Any) -> None:
    layout = transport.layout("float16")
    payloads = [random_payload(layout, 1 + i % 5, seed=i) for i in range(16)]

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        senders = [transport.make_sender() for _ in range(4)]
        address = await receiver.start()
        try:
            for i in range(16):
                receiver.expect(f"r{i}")
            headers = [
                make_header(f"r{i}", "m", layout, p, transport.token)
                for i, p in enumerate(payloads)
            ]
            sends = [
                senders[i % 4].send(address, h, p, timeout_s=30)
                for i, (h, p) in enumerate(zip(headers, payloads, strict=True))
            ]
            await asyncio.gather(*sends)
            for i, p in enumerate(payloads):
                got = await receiver.claim(f"r{i}", timeout_s=30)
                assert np.array_equal(got.payload, p)
            assert receiver.num_pending == 0
        finally:
            for sender in senders:
                await sender.close()
            await receiver.close()

    transport.run(body())


async def _refused(
    transport: Any,
    *,
    corrupt: bool = False,
    corrupt_at: float = 0.5,
    num_blocks: int = 3,
    token: str | None = None,
    layout_dtype: str | None = None,
    receiver_dtype: str = "bfloat16",
    expect: bool = True,
) -> tuple[TransferError, BaseException | None, int]:
    """Push one refused transfer; return (sender's error, claim's error, buffered bytes)."""
    layout = transport.layout(receiver_dtype)
    send_layout = transport.layout(layout_dtype) if layout_dtype else layout
    payload = random_payload(send_layout, num_blocks)
    receiver = transport.make_receiver(transport.config(layout))
    sender = transport.make_sender()
    address = await receiver.start()
    try:
        if expect:
            receiver.expect("req")
        header = make_header("req", "m", send_layout, payload, token or transport.token)
        if corrupt:
            payload = payload.copy()
            payload[min(payload.size - 1, int(payload.size * corrupt_at))] ^= 0xFF  # after sums
        with pytest.raises(TransferError) as sent:
            await sender.send(address, header, payload, timeout_s=30)
        buffered = receiver.core.num_buffered_bytes
        claim_error: BaseException | None = None
        if expect:
            try:
                await receiver.claim("req", timeout_s=0.2 if not corrupt else 30)
            except TransferError as exc:
                claim_error = exc
        assert receiver.num_pending == 0
        return sent.value, claim_error, buffered
    finally:
        await sender.close()
        await receiver.close()


def test_corrupted_byte_is_refused_on_both_sides(transport: Any) -> None:
    sent, claimed, buffered = transport.run(_refused(transport, corrupt=True))
    assert isinstance(sent, ChecksumMismatchError)
    assert isinstance(claimed, ChecksumMismatchError)  # decode learns at once: falls back
    assert buffered == 0


@pytest.mark.parametrize("corrupt_at", [0.0, 0.3, 1.0], ids=["first", "inner", "last"])
def test_corruption_in_any_chunk_of_a_large_payload_is_refused(
    transport: Any, corrupt_at: float
) -> None:
    # 512 blocks of 32 KiB: rows of 2 MiB, so backends that pipeline the payload in
    # chunks (UCX: 8 here) verify it as chunks arrive; every chunk's bytes must count
    run = _refused(transport, corrupt=True, corrupt_at=corrupt_at, num_blocks=512)
    sent, claimed, buffered = transport.run(run)
    assert isinstance(sent, ChecksumMismatchError)
    assert isinstance(claimed, ChecksumMismatchError)
    assert buffered == 0


def test_wrong_cluster_token_is_refused(transport: Any) -> None:
    sent, claimed, buffered = transport.run(_refused(transport, token="not-the-token"))
    assert isinstance(sent, UnauthorizedError)
    assert isinstance(claimed, TransferTimeoutError)  # the real transfer may still come
    assert buffered == 0


def test_layout_mismatch_is_refused(transport: Any) -> None:
    sent, _, buffered = transport.run(_refused(transport, layout_dtype="float32"))
    assert isinstance(sent, LayoutMismatchError)
    assert buffered == 0


@pytest.mark.parametrize(("sent", "taken"), [("int8", "fp8"), ("fp8", "bfloat16")])
def test_an_8bit_kv_format_is_refused_by_a_receiver_of_another(
    transport: Any, sent: str, taken: str
) -> None:
    """int8 and fp8 rows have the same size (head_dim codes + a 2-byte scale) but not the
    same values: a receiver takes only its own format, checked before any byte lands."""
    assert transport.layout("int8").block_bytes == transport.layout("fp8").block_bytes
    error, _, buffered = transport.run(_refused(transport, layout_dtype=sent, receiver_dtype=taken))
    assert isinstance(error, LayoutMismatchError) and sent in str(error)
    assert buffered == 0


# The expected prompt's hash chain: 6 full blocks (any 32-byte values do for a transport).
CHAIN = tuple(bytes([i]) * 32 for i in range(1, 7))


@pytest.mark.parametrize("case", ["right", "model", "hash", "one_hash_short"])
def test_model_id_and_block_hashes_are_checked_against_the_expectation(
    transport: Any, case: str
) -> None:
    """The receiver takes only the expected model's KV of the expected prompt: the
    header's model id, and its hashes of blocks first_block_index.. against the
    expected chain's. A mismatch is refused on both sides at once (the decode worker
    prefills locally); the right ones arrive with the first token's logprobs."""
    layout = transport.layout()
    payload = random_payload(layout, 4)  # blocks 3..6 of the prompt: 5 full, 1 partial
    hashes = CHAIN[3:]
    model_id = "other-model" if case == "model" else "the-model"
    if case == "hash":
        hashes = (CHAIN[3], b"\xff" * 32, CHAIN[5])
    if case == "one_hash_short":
        hashes = CHAIN[3:5]
    top = ((7, -0.25), (42, -1.5))  # float32-exact: the wire carries float32

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        sender = transport.make_sender()
        address = await receiver.start()
        try:
            receiver.expect("req", model_id="the-model", block_hashes=CHAIN)
            header = make_header(
                *("req", model_id, layout, payload, transport.token),
                block_hashes=hashes,
                first_block_index=3,
                first_token=7,
                first_token_logprob=-0.25,
                first_token_top_logprobs=top,
            )
            if case == "right":
                await sender.send(address, header, payload, timeout_s=30)
                got = await receiver.claim("req", timeout_s=30)
                assert np.array_equal(got.payload, payload)
                assert got.header.block_hashes == CHAIN[3:]
                assert got.header.first_token_logprob == -0.25
                assert got.header.first_token_top_logprobs == top
                got.release()
            else:
                with pytest.raises(KVMismatchError):
                    await sender.send(address, header, payload, timeout_s=30)
                assert receiver.core.num_buffered_bytes == 0
                with pytest.raises(KVMismatchError):  # at once: the right KV will not come
                    await receiver.claim("req", timeout_s=5)
            assert receiver.num_pending == 0
        finally:
            await sender.close()
            await receiver.close()

    transport.run(body())


def test_logprobs_are_absent_unless_sent(transport: Any) -> None:
    """A header without logprobs says so (None), distinct from a logprob of 0.0."""
    layout = transport.layout()
    payload = random_payload(layout, 1)

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        sender = transport.make_sender()
        address = await receiver.start()
        try:
            for rid, logprob in (("absent", None), ("certain", 0.0)):
                receiver.expect(rid)
                header = make_header(
                    rid, "m", layout, payload, transport.token, first_token_logprob=logprob
                )
                await sender.send(address, header, payload, timeout_s=30)
                got = await receiver.claim(rid, timeout_s=30)
                assert got.header.first_token_logprob == logprob
                assert got.header.first_token_top_logprobs == ()
                got.release()
        finally:
            await sender.close()
            await receiver.close()

    transport.run(body())


def test_unknown_request_is_refused(transport: Any) -> None:
    sent, _, buffered = transport.run(_refused(transport, expect=False))
    assert isinstance(sent, UnknownRequestError)
    assert buffered == 0


def test_absent_receiver_gives_a_typed_error_in_time(transport: Any) -> None:
    layout = transport.layout()
    payload = random_payload(layout, 1)

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        address = await receiver.start()
        await receiver.close()  # nobody listens there any more
        sender = transport.make_sender()
        header = make_header("req", "m", layout, payload, transport.token)
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            with pytest.raises((PeerUnavailableError, TransferTimeoutError)):
                await sender.send(address, header, payload, timeout_s=2.0)
        finally:
            await sender.close()
        assert loop.time() - start < 2.0 + 0.5

    transport.run(body())


def test_unclaimed_kv_is_freed_when_its_lease_ends(transport: Any) -> None:
    layout = transport.layout()
    payload = random_payload(layout, 2)

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        sender = transport.make_sender()
        address = await receiver.start()
        lease_ended = asyncio.Event()
        receiver.core.on_lease_end = lambda request_id: lease_ended.set()
        try:
            receiver.expect("req")
            header = make_header("req", "m", layout, payload, transport.token, lease_ms=100)
            await sender.send(address, header, payload, timeout_s=30)
            assert receiver.core.num_buffered_bytes == payload.size
            await asyncio.wait_for(lease_ended.wait(), timeout=10)
            assert receiver.core.num_buffered_bytes == 0
            with pytest.raises(LeaseExpiredError):
                await receiver.claim("req", timeout_s=1)
            assert receiver.num_pending == 0
        finally:
            await sender.close()
            await receiver.close()

    transport.run(body())


def test_expectation_without_kv_times_out(transport: Any) -> None:
    async def body() -> None:
        receiver = transport.make_receiver(transport.config(transport.layout()))
        await receiver.start()
        try:
            receiver.expect("req", timeout_s=0.1)
            with pytest.raises(TransferTimeoutError):
                await receiver.claim("req", timeout_s=10)
            assert receiver.num_pending == 0
        finally:
            await receiver.close()

    transport.run(body())


async def _first(*aws: Any, timeout_s: float) -> None:
    """Wait until the first of `aws` completes (at most `timeout_s`); cancel the rest."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def test_sender_killed_mid_stream_frees_the_partial_transfer(socket_transport: Any) -> None:
    """A real sender process dies (SIGKILL) mid-push: its partial KV is freed, claim fails."""
    transport = socket_transport
    layout = transport.layout()

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        address = await receiver.start()
        core = receiver.core
        begun, freed = asyncio.Event(), asyncio.Event()
        begin, fail = core.begin, core.fail

        def begin_and_tell(header: TransferHeader, *args: Any) -> np.ndarray:
            buffer = begin(header, *args)
            begun.set()
            return buffer

        def fail_and_tell(part: TransferHeader | str, error: TransferError, *args: Any) -> None:
            fail(part, error, *args)  # the backend saw the stream break
            freed.set()

        core.begin, core.fail = begin_and_tell, fail_and_tell
        core.on_lease_end = lambda request_id: freed.set()  # the backstop
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "pdserve.kv_transfer.peer", "--transport"),
            *(transport.name, "--address", address, "--request-id", "req"),
            # UCX sees no break when its peer dies mid-push: the lease frees the partial
            # transfer, so the test waits it out (gRPC sees the break at once)
            *("--token", transport.token, "--num-bytes", str(1 << 30), "--lease-ms", "5000"),
            *("--num-layers", str(layout.num_layers), "--num-kv-heads", str(layout.num_kv_heads)),
            *("--head-dim", str(layout.head_dim), "--block-size", str(layout.block_size)),
            *("--dtype", layout.dtype),
            stdout=asyncio.subprocess.DEVNULL,
        )
        try:
            receiver.expect("req")
            await _first(begun.wait(), proc.wait(), timeout_s=30)
            assert begun.is_set(), f"the sender exited ({proc.returncode}) before a push began"
            assert proc.returncode is None, "the sender finished before it could be killed"
            proc.kill()
            await _first(freed.wait(), timeout_s=30)  # the stream break, or the lease at most
            assert core.num_buffered_bytes == 0
            with pytest.raises(TransferError):
                await receiver.claim("req", timeout_s=1)
            assert receiver.num_pending == 0
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            await receiver.close()

    transport.run(body())


@pytest.mark.parametrize("refusal", ["token", "layout", "unknown", "kv_mismatch"])
def test_a_refused_push_leaves_the_sender_able_to_push_again(transport: Any, refusal: str) -> None:
    """A refused push (of several chunks' worth) must not leave stale bytes behind: the
    same sender's next push to the same receiver lands whole. (A backend that sends the
    payload right behind the header has to drop a refused one.)"""
    layout = transport.layout("bfloat16")
    wrong = transport.layout("float32") if refusal == "layout" else layout
    refused_payload = random_payload(wrong, 512, seed=1)  # 16 MiB: several chunks
    payload = random_payload(layout, 64, seed=2)

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        sender = transport.make_sender()
        address = await receiver.start()
        try:
            token = "not-the-token" if refusal == "token" else transport.token
            if refusal == "kv_mismatch":
                receiver.expect("refused", model_id="another-model")
            header = make_header("refused", "m", wrong, refused_payload, token)
            with pytest.raises(TransferError):
                await sender.send(address, header, refused_payload, timeout_s=30)
            if refusal == "kv_mismatch":  # the expectation failed with the push
                with pytest.raises(KVMismatchError):
                    await receiver.claim("refused", timeout_s=5)
            receiver.expect("req")
            header = make_header("req", "m", layout, payload, transport.token)
            await sender.send(address, header, payload, timeout_s=30)
            got = await receiver.claim("req", timeout_s=30)
            assert np.array_equal(got.payload, payload)
            got.release()
            assert receiver.num_pending == 0 and receiver.core.num_buffered_bytes == 0
        finally:
            await sender.close()
            await receiver.close()

    transport.run(body())


def test_a_claim_after_the_wait_ran_out_says_timed_out_and_late_kv_is_refused(
    transport: Any,
) -> None:
    """A streaming call's generator may reach its claim only after the expectation
    expired: that is late KV (TransferTimeoutError), not an unknown request."""
    layout = transport.layout()
    payload = random_payload(layout, 1)

    async def body() -> None:
        receiver = transport.make_receiver(transport.config(layout))
        address = await receiver.start()
        sender = transport.make_sender()
        try:
            receiver.expect("req", timeout_s=0.01)
            deadline = time.monotonic() + 10
            while receiver.num_pending and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # until the expectation's own timer has run
            assert receiver.num_pending == 0
            header = make_header("req", "m", layout, payload, transport.token)
            with pytest.raises(UnknownRequestError):
                await sender.send(address, header, payload, timeout_s=30)
            with pytest.raises(TransferTimeoutError):
                await receiver.claim("req", timeout_s=10)
            with pytest.raises(UnknownRequestError):  # once: then it is forgotten
                await receiver.claim("req", timeout_s=10)
        finally:
            await sender.close()
            await receiver.close()

    transport.run(body())
