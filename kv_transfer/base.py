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

KV heads in parts (tensor parallelism, docs/kv-handoff.md): a header may say which of
the model's KV heads its payload holds (`kv_heads`, global indices [start, end); its
layout's `num_kv_heads` is the part's width). A receiver owns a range of heads
(`ReceiverConfig.kv_heads`) and takes one expected request in several parts, one
transfer each, from several senders; the request is complete when its verified parts
tile the receiver's range, and any part failing fails the whole request.
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
from dataclasses import dataclass, field, replace

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
# 8-bit KV formats (engine/kv_quant.py): a row (a token of one KV head) is head_dim one-byte
# codes and a 2-byte scale. A receiver takes only its own format: int8 and fp8 rows have
# the same size but do not mean the same values.
QUANTIZED_ROW_EXTRA = {"int8": 2, "fp8": 2}
_EXPIRED_KEPT = 4096  # expired request ids a receiver remembers for their late claim
Payload = bytes | bytearray | memoryview | np.ndarray
HeadRange = tuple[int, int]  # KV heads [start, end), the model's global head indices


@dataclass(frozen=True)
class KVLayout:
    """Shape of KV blocks; sender and receiver must agree exactly."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE and self.dtype not in QUANTIZED_ROW_EXTRA:
            known = sorted([*ITEMSIZE, *QUANTIZED_ROW_EXTRA])
            raise ValueError(f"unsupported KV dtype {self.dtype!r} (one of {known})")

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of one KV head's K (or V): head_dim values, or an 8-bit
        format's head_dim codes and their scale."""
        if self.dtype in QUANTIZED_ROW_EXTRA:
            return self.head_dim + QUANTIZED_ROW_EXTRA[self.dtype]
        return self.head_dim * ITEMSIZE[self.dtype]

    @property
    def slab_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.num_kv_heads * self.block_size * self.row_bytes

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
    # The global KV heads the payload holds (one part of a request's KV, under tensor
    # parallelism); None: heads [0, layout.num_kv_heads). layout.num_kv_heads is the
    # part's width either way.
    kv_heads: HeadRange | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_heads", _head_range(self.kv_heads, self.layout, "header"))

    @property
    def head_range(self) -> HeadRange:
        """The global KV heads [start, end) the payload holds."""
        return self.kv_heads if self.kv_heads is not None else (0, self.layout.num_kv_heads)

    @property
    def num_blocks(self) -> int:
        return len(self.block_checksums)

    @property
    def payload_bytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes

    def to_proto(self) -> pb.TransferHeader:
        start, end = self.kv_heads or (0, 0)  # 0, 0: unset, absent from the wire
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
            kv_head_start=start,
            kv_head_end=end,
        )

    @classmethod
    def from_proto(cls, msg: pb.TransferHeader) -> TransferHeader:
        """Raises BadHeaderError when the header is inconsistent in itself."""
        layout = KVLayout.from_proto(msg.layout)
        # kv_head_end 0: unset (a kv_head_start without it is refused below: start >= end)
        unset = msg.kv_head_end == 0 and msg.kv_head_start == 0
        try:
            header = cls(
                request_id=msg.request_id,
                model_id=msg.model_id,
                layout=layout,
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
                kv_heads=None if unset else (msg.kv_head_start, msg.kv_head_end),
            )
        except ValueError as exc:  # the KV-head range does not fit the layout
            raise BadHeaderError(str(exc)) from exc
        if not header.request_id or msg.num_blocks != header.num_blocks:
            raise BadHeaderError("header lacks a request id or its block counts disagree")
        if msg.payload_bytes != header.payload_bytes:
            raise BadHeaderError(
                f"payload_bytes {msg.payload_bytes} != {header.num_blocks} blocks of the layout"
            )
        return header


def _head_range(kv_heads: HeadRange | None, layout: KVLayout, what: str) -> HeadRange | None:
    """`kv_heads` as a pair of ints, checked against `layout` (ValueError if it does not
    fit: an empty range, or one of another width than the layout's)."""
    if kv_heads is None:
        return None
    start, end = kv_heads
    start, end = int(start), int(end)
    if not 0 <= start < end:
        raise ValueError(f"{what} KV heads [{start}, {end}) are no range of heads")
    if end - start != layout.num_kv_heads:
        raise ValueError(
            f"{what} KV heads [{start}, {end}) are {end - start} heads, its layout has "
            f"{layout.num_kv_heads}"
        )
    return start, end


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
    kv_heads: HeadRange | None = None,
) -> TransferHeader:
    """The header of `payload`, its checksums computed.

    `kv_heads`: the global KV heads the payload holds, when it is one part of the KV
    (`layout` is then the part's: `num_kv_heads` = its width).
    """
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
        kv_heads=kv_heads,
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


@dataclass(frozen=True)
class ReceivedPart:
    """One part of a request's verified KV: the payload of KV heads `kv_heads` (global
    indices), laid out as `header.layout` (whose `num_kv_heads` is the part's width)."""

    header: TransferHeader
    payload: np.ndarray  # uint8, header.payload_bytes long, layout as kv_pack's buffer
    kv_heads: HeadRange  # header.head_range


@dataclass
class ReceivedKV:
    """Verified KV handed to the decode side by `claim`; the caller owns the payloads.

    `parts` (by head start) tile the receiver's KV heads: one part unless the sender
    side split the heads (tensor parallelism). `header` is the lowest part's (the fields
    every part must agree on are equal), `stats` covers all parts.

    Call `release()` once the payloads are copied into the KV cache: the buffers are then
    reused for later transfers (do not touch any payload after that).
    """

    header: TransferHeader
    parts: tuple[ReceivedPart, ...]
    stats: TransferStats  # bytes over all parts; blocks per part; first begin to last finish
    pool: BufferPool | None = field(default=None, repr=False)

    @property
    def payload(self) -> np.ndarray:
        """The one part's payload; ValueError for KV in several parts (read `parts`:
        no one part holds every head)."""
        if len(self.parts) != 1:
            ranges = ", ".join(f"[{a}, {b})" for a, b in (p.kv_heads for p in self.parts))
            raise ValueError(
                f"the KV of {self.header.request_id!r} came in {len(self.parts)} parts (KV "
                f"heads {ranges}): read `parts`, each holds the payload of its own heads"
            )
        return self.parts[0].payload

    def release(self) -> None:
        if self.pool is not None:
            for part in self.parts:
                self.pool.give(part.payload)
            self.pool = None


@dataclass(frozen=True)
class ReceiverConfig:
    cluster_token: str
    layout: KVLayout  # of all the KV heads this receiver owns
    host: str = "127.0.0.1"  # NOTE: never all interfaces unless configured
    port: int = 0  # 0: any free port
    max_payload_bytes: int = 8 << 30  # per transfer (a part, under tensor parallelism)
    max_lease_s: float = 60.0
    expect_timeout_s: float = 60.0
    buffer_pool_bytes: int = 1 << 30  # released buffers kept for reuse
    # The global KV heads this receiver owns (a tensor-parallel rank's); None: heads
    # [0, layout.num_kv_heads). layout.num_kv_heads is the range's width either way.
    kv_heads: HeadRange | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_heads", _head_range(self.kv_heads, self.layout, "receiver"))

    @property
    def head_range(self) -> HeadRange:
        """The global KV heads [start, end) this receiver owns."""
        return self.kv_heads if self.kv_heads is not None else (0, self.layout.num_kv_heads)


@dataclass
class _Part:
    """One transfer of an expected request: the KV heads of its header."""

    header: TransferHeader
    buffer: np.ndarray | None  # in flight or buffered; None once freed or handed over
    lease_timer: asyncio.TimerHandle | None
    started_s: float
    writer_done: bool = False  # the backend finished or failed: no more writes to buffer
    finished_s: float | None = None  # when its bytes were verified


@dataclass
class _Slot:
    """One expected request: its future result and what the receiver holds for it."""

    future: asyncio.Future[ReceivedKV]
    timer: asyncio.TimerHandle
    model_id: str | None = None  # what the header must say, when the expectation knows
    block_hashes: tuple[bytes, ...] | None = None  # the prompt's full blocks, from block 0
    parts: dict[int, _Part] = field(default_factory=dict)  # by head start


class ReceiverCore:
    """Backend-independent receiver state, confined to one asyncio event loop.

    A backend calls `begin` when a header arrives (gets a buffer to fill or a typed
    error to send back), then `finish` when all bytes are in, or `fail` if the stream
    broke, naming the transfer by the header `begin` accepted. Decode-side code calls
    `expect`, `claim` and `cancel`.

    Parts: a request's KV may come as several transfers, each holding a range of KV
    heads inside the receiver's own (`ReceiverConfig.kv_heads`), from several senders
    at once. Each has its own buffer and lease; the claim gets them all once the
    verified parts tile the receiver's range. A part that fails (or differs from
    another in what they must share) fails the request and frees every part.
    """

    def __init__(
        self,
        config: ReceiverConfig,
        on_transfer: Callable[[TransferStats], None] | None = None,
        on_lease_end: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self._on_transfer = on_transfer  # metrics hook: every verified transfer (part)
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
                for part in slot.parts.values():
                    part.buffer = None  # handed over to the caller
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
        return sum(
            p.buffer.size
            for s in self._slots.values()
            for p in s.parts.values()
            if p.buffer is not None
        )

    # -- backend side ------------------------------------------------------------

    def check(self, header: TransferHeader) -> None:
        """The checks of a header that need no request state: token, layout, size.

        The layout must be the receiver's but for `num_kv_heads` (a part's width), and
        the header's KV heads must lie in the receiver's; a header without `kv_heads`
        holds every head, so its layout must be the receiver's exactly.

        Safe from any thread (it reads only the config). Raises UnauthorizedError,
        LayoutMismatchError or PayloadTooLargeError.
        """
        cfg = self.config
        if not hmac.compare_digest(header.cluster_token.encode(), cfg.cluster_token.encode()):
            raise UnauthorizedError("wrong cluster token")
        width_aside = replace(header.layout, num_kv_heads=cfg.layout.num_kv_heads)
        if width_aside != cfg.layout or (header.kv_heads is None and header.layout != cfg.layout):
            raise LayoutMismatchError(f"layout {header.layout} != receiver's {cfg.layout}")
        (start, end), (own_start, own_end) = header.head_range, cfg.head_range
        if not own_start <= start < end <= own_end:
            raise LayoutMismatchError(
                f"KV heads [{start}, {end}) are not this receiver's [{own_start}, {own_end})"
            )
        if header.payload_bytes > cfg.max_payload_bytes:
            raise PayloadTooLargeError(f"{header.payload_bytes} bytes > {cfg.max_payload_bytes}")

    def begin(self, header: TransferHeader, buffer: np.ndarray | None = None) -> np.ndarray:
        """Validate a header (a part: its KV heads) and return the buffer its payload
        goes into.

        `buffer`: one the backend already took from `pool` (exactly `payload_bytes`
        long) to receive into before this call; the core owns it from here on. On a
        refusal the caller keeps it.

        Raises UnauthorizedError, LayoutMismatchError, UnknownRequestError,
        DuplicateTransferError (a part of the request with any of these heads has begun
        already), PayloadTooLargeError or KVMismatchError; nothing is held then. A
        KVMismatchError also fails the expectation (the claimer gets it): a sender with
        the cluster token pushed KV that is not this request's, or a part that differs
        from another part in what they must share, so the right KV will not come.
        """
        self.check(header)
        if buffer is not None and buffer.size != header.payload_bytes:
            raise ValueError(f"buffer of {buffer.size} bytes for {header.payload_bytes}")
        request_id = header.request_id
        slot = self._slots.get(request_id)
        if slot is None or slot.future.done():
            raise UnknownRequestError(f"request {request_id!r} is not expected here")
        start, end = header.head_range
        for part in slot.parts.values():
            a, b = part.header.head_range
            if a < end and start < b:
                raise DuplicateTransferError(
                    f"a transfer of KV heads [{a}, {b}) for {request_id!r} has begun already"
                )
        mismatch = _mismatch(slot, header)
        if mismatch is None and slot.parts:
            mismatch = _parts_differ(next(iter(slot.parts.values())).header, header)
        if mismatch is not None:
            error = KVMismatchError(f"request {request_id!r}: {mismatch}")
            self.fail(request_id, error)
            raise error
        lease_s = min(header.lease_ms / 1000, self.config.max_lease_s)
        slot.timer.cancel()  # from here on the leases bound the wait
        part = _Part(
            header,
            self.pool.take(header.payload_bytes) if buffer is None else buffer,
            asyncio.get_running_loop().call_later(lease_s, self._expire_lease, request_id),
            time.monotonic(),
        )
        slot.parts[start] = part
        assert part.buffer is not None
        return part.buffer

    def finish(
        self, header: TransferHeader, num_bytes: int, checksums: tuple[int, ...] | None = None
    ) -> TransferStats:
        """All bytes of the transfer of `header` (the one `begin` accepted) are in:
        verify them; hand the request's KV to the claimer once its parts are complete.

        `checksums` are the payload's block checksums if the backend computed them as
        the bytes arrived (`BlockHasher`); else they are computed here. Returns this
        transfer's stats.

        Raises UnknownRequestError if the transfer is not under way (any more: its
        request failed or was cancelled), TruncatedError or ChecksumMismatchError (the
        request's data is freed, and the claimer gets the same error).
        """
        found = self._part(header)
        buffer = None if found is None or found[1].finished_s is not None else found[1].buffer
        if found is None or buffer is None:
            start, end = header.head_range
            raise UnknownRequestError(
                f"no transfer of KV heads [{start}, {end}) under way for {header.request_id!r}"
            )
        slot, part = found
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
            self.fail(header, exc)
            raise
        part.writer_done = True
        part.finished_s = time.monotonic()
        stats = TransferStats(
            header.request_id, num_bytes, header.num_blocks, part.finished_s - part.started_s
        )
        self._complete(slot)
        if self._on_transfer is not None:
            self._on_transfer(stats)
        return stats

    def fail(
        self, part: TransferHeader | str, error: TransferError, writer_done: bool = True
    ) -> None:
        """End a request with `error`: free the bytes of all its parts and tell the
        claimer. No-op for a request (or transfer) that is not under way.

        `part`: the header `begin` accepted, when a backend ends a broken transfer; the
        backend must not write into that buffer after this call, and if it cannot
        promise that (`writer_done=False`), the buffer is dropped rather than reused.
        Or a request id, to fail the whole request by name: a part whose writer is still
        busy then has its buffer dropped, not reused (`writer_done` is not used).
        """
        if isinstance(part, TransferHeader):
            found = self._part(part)
            if found is None or found[1].finished_s is not None:
                return  # already ended, or verified: its writer has reported
            found[1].writer_done = writer_done
            request_id = part.request_id
        else:
            request_id = part
        slot = self._slots.get(request_id)
        if slot is not None:
            self._end(request_id, slot, error)

    # -- internals ---------------------------------------------------------------

    def _part(self, header: TransferHeader) -> tuple[_Slot, _Part] | None:
        """The slot and part of the transfer `begin` accepted with `header`, if held."""
        slot = self._slots.get(header.request_id)
        part = None if slot is None else slot.parts.get(header.head_range[0])
        if slot is None or part is None or part.header is not header:
            return None
        return slot, part

    def _complete(self, slot: _Slot) -> None:
        """Hand the request's KV to the claimer if its verified parts tile this
        receiver's heads (parts lie inside them and never overlap: widths suffice)."""
        done = sorted(
            (p for p in slot.parts.values() if p.finished_s is not None),
            key=lambda p: p.header.head_range[0],
        )
        own_start, own_end = self.config.head_range
        if sum(p.header.layout.num_kv_heads for p in done) != own_end - own_start:
            return
        parts = tuple(
            ReceivedPart(p.header, p.buffer, p.header.head_range)
            for p in done
            if p.buffer is not None
        )
        first = done[0].header
        stats = TransferStats(
            first.request_id,
            sum(p.header.payload_bytes for p in done),
            first.num_blocks,
            max(p.finished_s or 0.0 for p in done) - min(p.started_s for p in done),
        )
        slot.future.set_result(ReceivedKV(first, parts, stats))

    def _end(self, request_id: str, slot: _Slot, error: TransferError) -> None:
        """Fail a request: free every part, and tell a claim (even after its KV was
        verified) why; the failed slot stays for a claim to read until the
        expectation's own timeout."""
        self._free(slot)
        loop = asyncio.get_running_loop()
        if slot.future.done() and slot.future.exception() is None:
            slot.future = loop.create_future()  # the verified KV is gone
        _set_error(slot.future, error)
        if slot.timer.cancelled():  # a transfer had begun
            slot.timer = loop.call_later(self.config.expect_timeout_s, self._drop, request_id)

    def _expire(self, request_id: str, why: str) -> None:
        slot = self._slots.get(request_id)
        if slot is not None:
            _set_error(slot.future, TransferTimeoutError(f"{request_id!r}: {why}"))
            self._expired[request_id] = None
            while len(self._expired) > _EXPIRED_KEPT:
                self._expired.popitem(last=False)
        self._drop(request_id)

    def _expire_lease(self, request_id: str) -> None:
        """A part's lease ended: free the request's KV, verified or not."""
        slot = self._slots.get(request_id)
        if slot is None:
            return
        error: TransferError
        if slot.future.done() and slot.future.exception() is None:
            # buffered but never claimed: a late claim learns why it is gone
            error = LeaseExpiredError(f"lease of {request_id!r} ended")
        else:
            done = sorted(
                p.header.head_range for p in slot.parts.values() if p.finished_s is not None
            )
            arrived = ", ".join(f"[{a}, {b})" for a, b in done) or "none"
            own_start, own_end = self.config.head_range
            error = TruncatedError(
                f"{request_id!r} incomplete at lease end (KV heads verified: {arrived}; "
                f"this receiver's: [{own_start}, {own_end}))"
            )
        self._end(request_id, slot, error)
        if self.on_lease_end is not None:
            self.on_lease_end(request_id)

    def _free(self, slot: _Slot) -> None:
        for part in slot.parts.values():
            if part.buffer is not None and part.writer_done:
                self.pool.give(part.buffer)
            # NOTE: a buffer a backend may still write into is only dropped, never pooled.
            part.buffer = None
            if part.lease_timer is not None:
                part.lease_timer.cancel()
                part.lease_timer = None
        slot.parts.clear()

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


# what every part of one request must agree on: one prefill's blocks, one first token
_SHARED_BY_PARTS = (
    "model_id",
    "num_blocks",
    "first_block_index",
    "block_hashes",
    "first_token",
    "first_token_logprob",
    "first_token_top_logprobs",
)


def _parts_differ(earlier: TransferHeader, header: TransferHeader) -> str | None:
    """How part `header` differs from an `earlier` part of the same request (None: in
    nothing they must share)."""
    for name in _SHARED_BY_PARTS:
        if getattr(header, name) != getattr(earlier, name):
            (a, b), (c, d) = header.head_range, earlier.head_range
            return f"part of KV heads [{a}, {b}) differs from part [{c}, {d}) in {name}"
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
