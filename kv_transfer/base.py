"""The KV transfer API: what a prefill worker sends and a decode worker receives.

A transfer moves one request's KV blocks (all layers) from P to D: a `TransferHeader`
(request id, model id, layout, block hashes, the first token and its logprobs, a
checksum per block, a lease, the cluster token) and a payload, the bytes
`kernels/kv_pack.py` produces:

    payload [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]  (layer-major)

Block i's checksum is xxh3-64 over its 2 * num_layers slabs `payload[l, kv, i]`, in
(layer, kv) order (`block_checksums`).

Who frees what, when (docs/kv-handoff.md):
- The sender owns its payload until `KVSender.send` returns or raises; it never waits
  longer than `timeout_s`. On success the receiver has verified and buffered the KV; on
  any error (typed, see `errors.py`) nothing is buffered, and the caller unreferences
  its blocks either way.
- The receiver only accepts a request it `expect`s (else `UnknownRequestError`), from a
  sender with the cluster token, with its own layout, and, when the expectation names
  them, for the expected model and prompt: the header's model id and block hashes must
  be those the decode worker computed from the request (else `KVMismatchError`, which
  fails the expectation too, so the decode worker prefills locally at once). Arriving
  bytes live in a buffer the receiver owns; a partial transfer (the sender died, the
  stream broke) is freed at once, or at the latest when its lease ends. Verified KV
  waits, buffered, until `claim` takes it (then the caller owns it) or its lease ends
  (then it is freed and the claim fails with `LeaseExpiredError`). `cancel` drops
  everything of a request.
- An expectation itself ends after `expect_timeout_s`, so nothing waits forever.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import hmac
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from pdserve.kv_transfer.errors import (
    BadHeaderError,
    ChecksumMismatchError,
    DuplicateTransferError,
    KVMismatchError,
    LayoutMismatchError,
    LeaseExpiredError,
    PayloadTooLargeError,
    TransferError,
    TransferTimeoutError,
    TruncatedError,
    UnauthorizedError,
    UnknownRequestError,
)
from pdserve.protos import kv_transfer_pb2 as pb

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_EXPIRED_KEPT = 4096  # expired request ids a receiver remembers for their late claim
Payload = bytes | bytearray | memoryview | np.ndarray


@dataclass(frozen=True)
class KVLayout:
    """Shape of KV blocks; sender and receiver must agree exactly."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"unsupported KV dtype {self.dtype!r} (one of {sorted(ITEMSIZE)})")

    @property
    def slab_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.num_kv_heads * self.block_size * self.head_dim * ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return 2 * self.num_layers * self.slab_bytes

    def to_proto(self) -> pb.KVLayout:
        return pb.KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
        )

    @classmethod
    def from_proto(cls, msg: pb.KVLayout) -> KVLayout:
        try:
            return cls(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.block_size, msg.dtype)
        except ValueError as exc:
            raise LayoutMismatchError(str(exc)) from exc


@dataclass(frozen=True)
class TransferHeader:
    request_id: str
    model_id: str
    layout: KVLayout
    block_checksums: tuple[int, ...]
    block_hashes: tuple[bytes, ...] = ()
    first_block_index: int = 0
    first_token: int = -1
    # Set when the request asked for logprobs: the first token's, and its top-n
    # alternatives as (token id, logprob), most likely first (float32 values).
    first_token_logprob: float | None = None
    first_token_top_logprobs: tuple[tuple[int, float], ...] = ()
    lease_ms: int = 30_000
    cluster_token: str = ""

    @property
    def num_blocks(self) -> int:
        return len(self.block_checksums)

    @property
    def payload_bytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes

    def to_proto(self) -> pb.TransferHeader:
        return pb.TransferHeader(
            request_id=self.request_id,
            model_id=self.model_id,
            layout=self.layout.to_proto(),
            num_blocks=self.num_blocks,
            block_hashes=list(self.block_hashes),
            first_block_index=self.first_block_index,
            first_token=self.first_token,
            first_token_logprob=self.first_token_logprob,  # None: left absent
            block_checksums=list(self.block_checksums),
            lease_ms=self.lease_ms,
            cluster_token=self.cluster_token,
            payload_bytes=self.payload_bytes,
            first_token_top_logprobs=[
                pb.TokenLogprob(token_id=t, logprob=v) for t, v in self.first_token_top_logprobs
            ],
        )

    @classmethod
    def from_proto(cls, msg: pb.TransferHeader) -> TransferHeader:
        """Raises BadHeaderError when the header is inconsistent in itself."""
        header = cls(
            request_id=msg.request_id,
            model_id=msg.model_id,
            layout=KVLayout.from_proto(msg.layout),
            block_checksums=tuple(msg.block_checksums),
            block_hashes=tuple(msg.block_hashes),
            first_block_index=msg.first_block_index,
            first_token=msg.first_token,
            first_token_logprob=(
                msg.first_token_logprob if msg.HasField("first_token_logprob") else None
            ),
            first_token_top_logprobs=tuple(
                (t.token_id, t.logprob) for t in msg.first_token_top_logprobs
            ),
            lease_ms=msg.lease_ms,
            cluster_token=msg.cluster_token,
        )
        if not header.request_id or msg.num_blocks != header.num_blocks:
            raise BadHeaderError("header lacks a request id or its block counts disagree")
        if msg.payload_bytes != header.payload_bytes:
            raise BadHeaderError(
                f"payload_bytes {msg.payload_bytes} != {header.num_blocks} blocks of the layout"
            )
        return header


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_malloc() -> bool:
    """Keep freed heap memory for reuse instead of handing it back to the kernel.

    gRPC allocates (and frees) a fresh buffer for every message it sends or receives,
    1 MiB each here. glibc's defaults return such memory to the kernel at once (munmap,
    or trimming the heap top past 2x the last size), so every message pays for page
    faults on memory it just freed: measured, gRPC moved 256 MiB at ~1.2 GB/s that way
    and at ~2.1 GB/s with this. Kept memory is bounded: at most 256 MiB of free heap
    top, and blocks of 32 MiB or more are still mapped and unmapped on their own.
    Process-wide, so the worker processes call it once at start. Returns False (and
    changes nothing) where the C library is not glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, 32 << 20),
            (_M_TRIM_THRESHOLD, 256 << 20),
            (_M_TOP_PAD, 64 << 20),
        )
    )


def as_bytes(payload: Payload) -> np.ndarray:
    """A flat uint8 view of a payload (no copy)."""
    if isinstance(payload, np.ndarray):
        return payload.reshape(-1).view(np.uint8)
    return np.frombuffer(payload, dtype=np.uint8)


class BlockHasher:
    """Block checksums computed while a payload arrives, slab by slab.

    A payload is 2 * num_layers rows (one per layer and kv), each row holding one slab
    of every block; block i's checksum hashes its slabs in row order. Slabs in payload
    order are in that order for every block, so a backend can hash each slab as soon
    as its bytes are in (while they are still in cache), and the result equals
    `block_checksums`.
    """

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.num_rows = 2 * layout.num_layers
        self.slabs_done = 0
        self._digests = [xxhash.xxh3_64() for _ in range(num_blocks)]

    @property
    def rows_done(self) -> int:
        return self.slabs_done // max(1, self.num_blocks)

    def update(self, payload: Payload, rows_end: int) -> None:
        """Hash rows [rows_done, rows_end) of `payload` (the whole payload's buffer)."""
        self.update_bytes(payload, rows_end * self.num_blocks * self.layout.slab_bytes)

    def update_bytes(self, payload: Payload, end: int) -> None:
        """Hash every whole slab of `payload` (the whole payload's buffer) that lies
        before byte `end` and is not hashed yet."""
        data = as_bytes(payload)
        if data.size != self.num_blocks * self.layout.block_bytes:
            raise TruncatedError(
                f"payload has {data.size} bytes, {self.num_blocks} blocks need "
                f"{self.num_blocks * self.layout.block_bytes}"
            )
        if not self.num_blocks:
            return
        slabs = data.reshape(-1, self.layout.slab_bytes)
        slabs_end = min(end // self.layout.slab_bytes, slabs.shape[0])
        digests, num_blocks = self._digests, self.num_blocks
        for k in range(self.slabs_done, slabs_end):
            digests[k % num_blocks].update(slabs[k])
        self.slabs_done = max(self.slabs_done, slabs_end)

    def checksums(self) -> tuple[int, ...]:
        if self.rows_done != self.num_rows and self.num_blocks:
            raise TruncatedError(f"only {self.rows_done} of {self.num_rows} rows hashed")
        return tuple(d.intdigest() for d in self._digests)


def block_checksums(payload: Payload, layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
    """xxh3-64 of each block: its 2 * num_layers slabs in (layer, kv) order."""
    hasher = BlockHasher(layout, num_blocks)
    hasher.update(payload, hasher.num_rows)
    return hasher.checksums()


def row_chunks(
    layout: KVLayout, num_blocks: int, max_chunks: int = 16, min_chunk_bytes: int = 2 << 20
) -> list[tuple[int, int]]:
    """Split a payload into at most `max_chunks` runs of whole rows, (start, end) each.

    Backends that pipeline (receive one chunk while hashing the one before) cut the
    payload this way on both sides, from the header alone.
    """
    num_rows = 2 * layout.num_layers
    row_bytes = num_blocks * layout.slab_bytes
    per_chunk = max(1, -(-num_rows // max_chunks), -(-min_chunk_bytes // max(1, row_bytes)))
    return [(j, min(j + per_chunk, num_rows)) for j in range(0, num_rows, per_chunk)]


def make_header(
    request_id: str,
    model_id: str,
    layout: KVLayout,
    payload: Payload,
    cluster_token: str,
    *,
    block_hashes: tuple[bytes, ...] = (),
    first_block_index: int = 0,
    first_token: int = -1,
    first_token_logprob: float | None = None,
    first_token_top_logprobs: tuple[tuple[int, float], ...] = (),
    lease_ms: int = 30_000,
) -> TransferHeader:
    """The header of `payload`, its checksums computed."""
    num_blocks, rest = divmod(as_bytes(payload).size, layout.block_bytes)
    if rest:
        raise ValueError(f"payload is not a whole number of {layout.block_bytes}-byte blocks")
    return TransferHeader(
        request_id=request_id,
        model_id=model_id,
        layout=layout,
        block_checksums=block_checksums(payload, layout, num_blocks),
        block_hashes=block_hashes,
        first_block_index=first_block_index,
        first_token=first_token,
        first_token_logprob=first_token_logprob,
        first_token_top_logprobs=first_token_top_logprobs,
        lease_ms=lease_ms,
        cluster_token=cluster_token,
    )


@dataclass(frozen=True)
class TransferStats:
    """Metrics hook: what one transfer moved and how long it took."""

    request_id: str
    num_bytes: int
    num_blocks: int
    seconds: float


class BufferPool:
    """Reuses receive buffers: a fresh 256 MiB buffer costs ~45 ms of page faults here.

    Only a buffer no writer can touch any more may come back (`give`): one the consumer
    released, or one whose transfer the backend itself ended.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()  # a backend may take, a consumer give, off-loop

    @property
    def num_free_bytes(self) -> int:
        with self._lock:
            return sum(b.size for b in self._free)

    def take(self, num_bytes: int) -> np.ndarray:
        """A uint8 buffer of exactly `num_bytes` (a view of a pooled one when possible)."""
        with self._lock:
            fits = [b for b in self._free if num_bytes <= b.size <= 2 * num_bytes]
            if not fits:
                base = None
            else:
                base = min(fits, key=lambda b: b.size)
                self._free = [b for b in self._free if b is not base]
        if base is None:
            return np.empty(num_bytes, dtype=np.uint8)
        return base[:num_bytes]

    def give(self, buffer: np.ndarray) -> None:
        base = buffer.base if isinstance(buffer.base, np.ndarray) else buffer
        with self._lock:
            if any(b is base for b in self._free):
                return
            if sum(b.size for b in self._free) + base.size <= self.max_bytes:
                self._free.append(base)


@dataclass
class ReceivedKV:
    """Verified KV handed to the decode side by `claim`; the caller owns `payload`.

    Call `release()` once the payload is copied into the KV cache: the buffer is then
    reused for a later transfer (do not touch `payload` after that).
    """

    header: TransferHeader
    payload: np.ndarray  # uint8, header.payload_bytes long, layout as kv_pack's buffer
    stats: TransferStats
    pool: BufferPool | None = field(default=None, repr=False)

    def release(self) -> None:
        if self.pool is not None:
            self.pool.give(self.payload)
            self.pool = None


@dataclass(frozen=True)
class ReceiverConfig:
    cluster_token: str
    layout: KVLayout
    host: str = "127.0.0.1"  # NOTE: never all interfaces unless configured
    port: int = 0  # 0: any free port
    max_payload_bytes: int = 8 << 30
    max_lease_s: float = 60.0
    expect_timeout_s: float = 60.0
    buffer_pool_bytes: int = 1 << 30  # released buffers kept for reuse


@dataclass
class _Slot:
    """One expected request: its future result and what the receiver holds for it."""

    future: asyncio.Future[ReceivedKV]
    timer: asyncio.TimerHandle
    buffer: np.ndarray | None = None  # in flight or buffered
    header: TransferHeader | None = None
    started_s: float = 0.0
    lease_timer: asyncio.TimerHandle | None = None
    writer_done: bool = False  # the backend finished or failed: no more writes to buffer
    model_id: str | None = None  # what the header must say, when the expectation knows
    block_hashes: tuple[bytes, ...] | None = None  # the prompt's full blocks, from block 0


class ReceiverCore:
    """Backend-independent receiver state, confined to one asyncio event loop.

    A backend calls `begin` when a header arrives (gets a buffer to fill or a typed
    error to send back), then `finish` when all bytes are in, or `fail` if the stream
    broke. Decode-side code calls `expect`, `claim` and `cancel`.
    """

    def __init__(
        self,
        config: ReceiverConfig,
        on_transfer: Callable[[TransferStats], None] | None = None,
        on_lease_end: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self._on_transfer = on_transfer  # metrics hook: every verified transfer
        self.on_lease_end = on_lease_end  # metrics hook: KV freed because its lease ended
        self.pool = BufferPool(config.buffer_pool_bytes)
        self._slots: dict[str, _Slot] = {}
        # ids whose wait ran out before anyone claimed them (the claimer may come later:
        # a streaming call's generator runs only when its caller asks for the next item),
        # so that claim says "timed out", not "never expected"; the oldest are forgotten
        self._expired: collections.OrderedDict[str, None] = collections.OrderedDict()

    # -- decode side -------------------------------------------------------------

    def expect(
        self,
        request_id: str,
        timeout_s: float | None = None,
        *,
        model_id: str | None = None,
        block_hashes: Sequence[bytes] | None = None,
    ) -> None:
        """Announce that KV for `request_id` may arrive; it must within `timeout_s`.

        `model_id` and `block_hashes` (the hash chain of the prompt's full blocks, from
        block 0) are what the request's KV must be for: a header that says otherwise
        is refused with `KVMismatchError` (None: not checked). The cluster token only
        says who may push; this says the push is the KV of this prompt on this model,
        so a mixed-up push (another model's pool, a reused request id) never decodes.
        """
        if request_id in self._slots:
            raise DuplicateTransferError(f"request {request_id!r} is already expected")
        loop = asyncio.get_running_loop()
        wait_s = self.config.expect_timeout_s if timeout_s is None else timeout_s
        timer = loop.call_later(wait_s, self._expire, request_id, "no KV arrived in time")
        self._slots[request_id] = _Slot(
            future=loop.create_future(),
            timer=timer,
            model_id=model_id,
            block_hashes=None if block_hashes is None else tuple(block_hashes),
        )

    async def claim(self, request_id: str, timeout_s: float) -> ReceivedKV:
        """Wait (at most `timeout_s`) for the request's verified KV and take ownership.

        Raises the transfer's typed error, `TransferTimeoutError` on timeout, or
        `UnknownRequestError` if the request is not expected. The request is forgotten
        either way.
        """
        slot = self._slots.get(request_id)
        if slot is None:
            if request_id in self._expired:
                del self._expired[request_id]
                raise TransferTimeoutError(f"no KV for {request_id!r} before its wait ran out")
            raise UnknownRequestError(f"request {request_id!r} is not expected")
        try:
            received = await asyncio.wait_for(asyncio.shield(slot.future), timeout_s)
        except TimeoutError:
            raise TransferTimeoutError(f"no KV for {request_id!r} within {timeout_s}s") from None
        finally:
            if slot.future.done() and not slot.future.exception():
                slot.buffer = None  # handed over to the caller
            self._drop(request_id)
        received.pool = self.pool
        return received

    def cancel(self, request_id: str) -> None:
        """Forget a request: free whatever arrived or is arriving for it. Idempotent."""
        self._expired.pop(request_id, None)
        slot = self._slots.get(request_id)
        if slot is not None:
            _set_error(slot.future, UnknownRequestError(f"request {request_id!r} cancelled"))
        self._drop(request_id)

    def cancel_all(self) -> None:
        """Forget every request (receiver shutdown)."""
        for request_id in list(self._slots):
            self.cancel(request_id)

    @property
    def num_pending(self) -> int:
        """Requests expected, in flight or buffered (0 after every test: leak check)."""
        return len(self._slots)

    @property
    def num_buffered_bytes(self) -> int:
        return sum(s.buffer.size for s in self._slots.values() if s.buffer is not None)

    # -- backend side ------------------------------------------------------------

    def check(self, header: TransferHeader) -> None:
        """The checks of a header that need no request state: token, layout, size.

        Safe from any thread (it reads only the config). Raises UnauthorizedError,
        LayoutMismatchError or PayloadTooLargeError.
        """
        cfg = self.config
        if not hmac.compare_digest(header.cluster_token.encode(), cfg.cluster_token.encode()):
            raise UnauthorizedError("wrong cluster token")
        if header.layout != cfg.layout:
            raise LayoutMismatchError(f"layout {header.layout} != receiver's {cfg.layout}")
        if header.payload_bytes > cfg.max_payload_bytes:
            raise PayloadTooLargeError(f"{header.payload_bytes} bytes > {cfg.max_payload_bytes}")

    def begin(self, header: TransferHeader, buffer: np.ndarray | None = None) -> np.ndarray:
        """Validate a header and return the buffer its payload goes into.

        `buffer`: one the backend already took from `pool` (exactly `payload_bytes`
        long) to receive into before this call; the core owns it from here on. On a
        refusal the caller keeps it.

        Raises UnauthorizedError, LayoutMismatchError, UnknownRequestError,
        DuplicateTransferError, PayloadTooLargeError or KVMismatchError; nothing is
        held then. A KVMismatchError also fails the expectation (the claimer gets it):
        a sender with the cluster token pushed KV that is not this request's, so the
        right KV will not come.
        """
        self.check(header)
        if buffer is not None and buffer.size != header.payload_bytes:
            raise ValueError(f"buffer of {buffer.size} bytes for {header.payload_bytes}")
        cfg = self.config
        slot = self._slots.get(header.request_id)
        if slot is None or slot.future.done():
            raise UnknownRequestError(f"request {header.request_id!r} is not expected here")
        if slot.buffer is not None:
            raise DuplicateTransferError(f"a transfer for {header.request_id!r} is under way")
        mismatch = _mismatch(slot, header)
        if mismatch is not None:
            error = KVMismatchError(f"request {header.request_id!r}: {mismatch}")
            self.fail(header.request_id, error)
            raise error
        lease_s = min(header.lease_ms / 1000, cfg.max_lease_s)
        slot.timer.cancel()  # from here on the lease bounds the wait
        slot.header, slot.started_s = header, time.monotonic()
        slot.buffer = self.pool.take(header.payload_bytes) if buffer is None else buffer
        slot.lease_timer = asyncio.get_running_loop().call_later(
            lease_s, self._expire_lease, header.request_id
        )
        return slot.buffer

    def finish(
        self, request_id: str, num_bytes: int, checksums: tuple[int, ...] | None = None
    ) -> TransferStats:
        """All bytes are in: verify them and hand them to the claimer.

        `checksums` are the payload's block checksums if the backend computed them as
        the bytes arrived (`BlockHasher`); else they are computed here.

        Raises TruncatedError or ChecksumMismatchError (the data is freed, and the
        claimer gets the same error).
        """
        slot = self._slots.get(request_id)
        if slot is None or slot.header is None or slot.buffer is None:
            raise UnknownRequestError(f"no transfer under way for {request_id!r}")
        header, buffer = slot.header, slot.buffer
        try:
            if num_bytes != header.payload_bytes:
                raise TruncatedError(f"got {num_bytes} of {header.payload_bytes} bytes")
            sums = checksums
            if sums is None:
                sums = block_checksums(buffer, header.layout, header.num_blocks)
            bad = [
                i
                for i, (a, b) in enumerate(zip(sums, header.block_checksums, strict=True))
                if a != b
            ]
            if bad:
                raise ChecksumMismatchError(f"checksum mismatch in blocks {bad[:8]}")
        except TransferError as exc:
            self.fail(request_id, exc)
            raise
        slot.writer_done = True
        stats = TransferStats(
            request_id, num_bytes, header.num_blocks, time.monotonic() - slot.started_s
        )
        slot.future.set_result(ReceivedKV(header, buffer, stats))
        if self._on_transfer is not None:
            self._on_transfer(stats)
        return stats

    def fail(self, request_id: str, error: TransferError, writer_done: bool = True) -> None:
        """The backend ended a broken transfer: free its bytes and tell the claimer.

        The backend must not write into the buffer after this call; if it cannot promise
        that (`writer_done=False`), the buffer is dropped rather than reused.
        """
        slot = self._slots.get(request_id)
        if slot is not None:
            slot.writer_done = writer_done
            self._free(slot)
            _set_error(slot.future, error)

    # -- internals ---------------------------------------------------------------

    def _expire(self, request_id: str, why: str) -> None:
        slot = self._slots.get(request_id)
        if slot is not None:
            _set_error(slot.future, TransferTimeoutError(f"{request_id!r}: {why}"))
            self._expired[request_id] = None
            while len(self._expired) > _EXPIRED_KEPT:
                self._expired.popitem(last=False)
        self._drop(request_id)

    def _expire_lease(self, request_id: str) -> None:
        slot = self._slots.get(request_id)
        if slot is None:
            return
        verified = slot.future.done() and slot.future.exception() is None
        self._free(slot)
        if verified:  # buffered but never claimed: a late claim learns why it is gone
            slot.future = asyncio.get_running_loop().create_future()
            _set_error(slot.future, LeaseExpiredError(f"lease of {request_id!r} ended"))
        else:
            _set_error(slot.future, TruncatedError(f"{request_id!r} incomplete at lease end"))
        # the failed slot stays for a claim to read, until the expectation's own timeout
        slot.timer.cancel()
        slot.timer = asyncio.get_running_loop().call_later(
            self.config.expect_timeout_s, self._drop, request_id
        )
        if self.on_lease_end is not None:
            self.on_lease_end(request_id)

    def _free(self, slot: _Slot) -> None:
        if slot.buffer is not None and slot.writer_done:
            self.pool.give(slot.buffer)
        # NOTE: a buffer a backend may still write into is only dropped, never pooled.
        slot.buffer = None
        if slot.lease_timer is not None:
            slot.lease_timer.cancel()
            slot.lease_timer = None

    def _drop(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            slot.timer.cancel()
            self._free(slot)


def _mismatch(slot: _Slot, header: TransferHeader) -> str | None:
    """How `header` differs from what `slot` expects (None: as expected).

    The header carries the hashes of the full prompt blocks it sends, from
    `first_block_index` on; they must be the expected chain's from there to its end.
    """
    if slot.model_id is not None and header.model_id != slot.model_id:
        return f"KV of model {header.model_id!r}, expected {slot.model_id!r}"
    if slot.block_hashes is not None:
        want = slot.block_hashes[header.first_block_index :]
        if header.block_hashes != want:
            pairs = zip(header.block_hashes, want, strict=False)  # lengths may differ
            bad = next(
                (i for i, (a, b) in enumerate(pairs) if a != b),
                min(len(header.block_hashes), len(want)),
            )
            return (
                f"block hashes differ from the prompt's at block "
                f"{header.first_block_index + bad} ({len(header.block_hashes)} sent from "
                f"block {header.first_block_index}, {len(want)} expected)"
            )
    return None


def _set_error(future: asyncio.Future[ReceivedKV], error: TransferError) -> None:
    if not future.done():
        future.set_exception(error)
        future.exception()  # mark retrieved: a claim may never come


class KVSender(ABC):
    """Pushes one request's KV to a receiver's address."""

    @abstractmethod
    async def send(
        self, address: str, header: TransferHeader, payload: Payload, timeout_s: float
    ) -> TransferStats:
        """Send header + payload; return once the receiver has verified and buffered it.

        Args:
            address: the receiver's `address` (backend-specific, e.g. "127.0.0.1:5555").
            header: from `make_header` (checksums of this very payload).
            payload: `header.payload_bytes` bytes; read-only here, owned by the caller.
            timeout_s: hard limit for the whole transfer, connection included.

        Raises:
            TransferError subclasses: the receiver's verdict (UnauthorizedError,
            ChecksumMismatchError, UnknownRequestError, ...), PeerUnavailableError if it
            cannot be reached, TransferTimeoutError past `timeout_s`.
        """

    @abstractmethod
    async def close(self) -> None:
        """Close every connection this sender holds. Idempotent."""


class KVReceiver(ABC):
    """Accepts pushes on its own endpoint and holds them in a `ReceiverCore`."""

    core: ReceiverCore

    @abstractmethod
    async def start(self) -> str:
        """Start listening; return the address senders use."""

    @abstractmethod
    async def close(self) -> None:
        """Stop listening, drop every connection and every held transfer. Idempotent."""

    def expect(
        self,
        request_id: str,
        timeout_s: float | None = None,
        *,
        model_id: str | None = None,
        block_hashes: Sequence[bytes] | None = None,
    ) -> None:
        """`ReceiverCore.expect`: the request's KV may arrive, for this model and prompt."""
        self.core.expect(request_id, timeout_s, model_id=model_id, block_hashes=block_hashes)

    async def claim(self, request_id: str, timeout_s: float) -> ReceivedKV:
        return await self.core.claim(request_id, timeout_s)

    def cancel(self, request_id: str) -> None:
        self.core.cancel(request_id)

    @property
    def num_pending(self) -> int:
        return self.core.num_pending
