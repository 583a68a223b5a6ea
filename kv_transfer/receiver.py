"""The receiver's state machine, shared by every transport: expectations, parts,
verification, leases and claims (the lifecycle is kv_transfer/base.py's docstring).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from pdserve.kv_transfer.buffers import BufferPool
from pdserve.kv_transfer.checksums import block_checksums
from pdserve.kv_transfer.errors import (
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
from pdserve.kv_transfer.header import (
    HeadRange,
    KVLayout,
    TransferHeader,
    TransferStats,
    _head_range,
)

_EXPIRED_KEPT = 4096  # expired request ids a receiver remembers for their late claim


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
    leading: bool = False  # a peer fetch: the leading part of `block_hashes` will do
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
        leading: bool = False,
    ) -> None:
        """Announce that KV for `request_id` may arrive; it must within `timeout_s`.

        `model_id` and `block_hashes` (the hash chain of the prompt's full blocks, from
        block 0) are what the request's KV must be for: a header that says otherwise
        is refused with `KVMismatchError` (None: not checked). The cluster token only
        says who may push; this says the push is the KV of this prompt on this model,
        so a mixed-up push (another model's pool, a reused request id) never decodes.
        `leading` (a peer fetch, whose holder may have lost the last blocks meanwhile):
        KV of the chain's first blocks only, at least one, is taken too.
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
            leading=leading,
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
        if slot.leading and 0 < len(header.block_hashes) < len(want):
            want = want[: len(header.block_hashes)]
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
