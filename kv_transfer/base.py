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

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pdserve.kv_transfer.buffers import BufferPool, tune_malloc
from pdserve.kv_transfer.checksums import (
    BlockHasher,
    as_bytes,
    block_checksums,
    make_header,
    row_chunks,
)
from pdserve.kv_transfer.header import (
    ITEMSIZE,
    QUANTIZED_ROW_EXTRA,
    HeadRange,
    KVLayout,
    Payload,
    TransferHeader,
    TransferStats,
)
from pdserve.kv_transfer.receiver import ReceivedKV, ReceivedPart, ReceiverConfig, ReceiverCore

__all__ = [
    "ITEMSIZE",
    "QUANTIZED_ROW_EXTRA",
    "BlockHasher",
    "BufferPool",
    "HeadRange",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "Payload",
    "ReceivedKV",
    "ReceivedPart",
    "ReceiverConfig",
    "ReceiverCore",
    "TransferHeader",
    "TransferStats",
    "as_bytes",
    "block_checksums",
    "make_header",
    "row_chunks",
    "tune_malloc",
]


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
        leading: bool = False,
    ) -> None:
        """`ReceiverCore.expect`: the request's KV may arrive, for this model and prompt."""
        self.core.expect(
            request_id, timeout_s, model_id=model_id, block_hashes=block_hashes, leading=leading
        )

    async def claim(self, request_id: str, timeout_s: float) -> ReceivedKV:
        return await self.core.claim(request_id, timeout_s)

    def cancel(self, request_id: str) -> None:
        self.core.cancel(request_id)

    @property
    def num_pending(self) -> int:
        return self.core.num_pending
