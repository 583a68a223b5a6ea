"""What travels in front of a KV transfer's payload: the KV layout (`KVLayout`) and the
`TransferHeader`. The checksums it carries are checksums.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.kv_transfer.errors import (
    BadHeaderError,
    LayoutMismatchError,
)
from pdserve.protos import kv_transfer_pb2 as pb

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# 8-bit KV formats (engine/modeling/kv_quant.py): a row (a token of one KV head) is
# head_dim one-byte codes and a 2-byte scale. A receiver takes only its own format: int8
# and fp8 rows have the same size but do not mean the same values.
QUANTIZED_ROW_EXTRA = {"int8": 2, "fp8": 2}
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


@dataclass(frozen=True)
class TransferStats:
    """Metrics hook: what one transfer moved and how long it took."""

    request_id: str
    num_bytes: int
    num_blocks: int
    seconds: float
