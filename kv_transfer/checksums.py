"""A KV payload's block checksums (xxh3-64 per block, over its 2 * num_layers slabs in
(layer, kv) order), and `make_header`, which puts them in a transfer's header.
"""

from __future__ import annotations

import numpy as np
import xxhash

from pdserve.kv_transfer.errors import (
    TruncatedError,
)
from pdserve.kv_transfer.header import HeadRange, KVLayout, Payload, TransferHeader


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
