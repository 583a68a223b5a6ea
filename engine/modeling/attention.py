"""Attention over a paged KV cache: the backend interface and its torch implementation.

All layers' KV cache is one tensor `[num_layers, 2, num_blocks, kv_heads, block_size,
head_dim]` (2 = K, V); a layer sees the views `[num_blocks, kv_heads, block_size,
head_dim]`. An 8-bit cache (`kv_cache_dtype` int8 or fp8) is the same shape of uint8
rows of `head_dim + 2` bytes, codes and their scale (engine/modeling/kv_quant.py). A block is
contiguous (a transfer ships whole blocks: `kernels/kv_pack.py`) and within it each
head's rows are contiguous (attention reads [tokens, head_dim] slabs). A token's *slot*
is `block_id * block_size + offset`.

A step's tokens arrive flat: first the prefill chunks (one or more new tokens per
sequence), then the decode tokens (exactly one per sequence, ordered by context
length). The runner builds one `AttentionMetadata` per step; every layer reuses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.engine.cpu.kernels import CpuKernels
from pdserve.engine.modeling import kv_quant

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PrefillMeta:
    """One sequence's prefill chunk inside the flat batch."""

    query_start: int  # first row of this chunk in the flat batch
    query_len: int  # new tokens in this chunk
    context_len: int  # tokens attended to: cached prefix + this chunk
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64 block ids


@dataclass
class PrefillBatch:
    """The prefill chunks as tensors, for kernels that take them in one launch."""

    block_tables: torch.Tensor  # [P, max_blocks] int32
    query_start_loc: torch.Tensor  # [P + 1] int32
    context_lens: torch.Tensor  # [P] int32


@dataclass
class DecodeMeta:
    """The decode rows (one token per sequence) at the end of the flat batch."""

    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    context_lens: torch.Tensor  # [B] int32, including the new token (ascending)
    context_lens_list: list[int]  # the same on the host


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    num_prefill_tokens: int
    prefills: list[PrefillMeta]
    prefill_batch: PrefillBatch | None
    decode: DecodeMeta | None
    # Indices a backend derives once per step and reuses in every layer.
    scratch: dict[str, Any] = field(default_factory=dict)


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and attends over it.

    Implementations: `TorchAttentionBackend` (any device) and the Triton backend of
    `pdserve.kernels` (CUDA). They must give the same outputs up to float rounding.
    """

    name: str
    # Whether the runner should also build `AttentionMetadata.prefill_batch`.
    wants_prefill_batch: bool = False
    # Whether the model runs its norms and rotary embedding in Triton kernels with this
    # backend (`engine/modeling/ops.py`): the fused forward, and decode steps as CUDA graphs.
    uses_triton_ops: bool = False
    # "auto" (the model's dtype), or an 8-bit format of engine/modeling/kv_quant.py
    kv_cache_dtype: str = "auto"

    @property
    def cpu_kernels(self) -> CpuKernels | None:
        """The compiled CPU kernels, whose model ops (engine/modeling/ops.py, CpuOps) go
        with them; None: this backend has none."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store k/v at `meta.slot_mapping`, then return attention output [T, H, D].

        Prefill rows attend causally to their sequence's cached prefix plus the chunk's
        own earlier tokens; decode rows attend to their whole context.
        Side effects: writes `kv_cache` in place.
        """


@dataclass
class _DecodeGroup:
    """Decode rows of similar context length, attended in one padded SDPA call."""

    rows: slice
    block_rows: torch.Tensor  # [KVH * b * max_blocks] rows of the [blocks * KVH, bs, D] view
    num_blocks: int
    mask: torch.Tensor  # [b, 1, 1, num_blocks * bs] bool, True where attended


def _block_rows(block_ids: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Rows [KVH, *block_ids.shape] of the cache viewed as [num_blocks * KVH, bs * D]."""
    heads = torch.arange(kv_heads, device=block_ids.device)
    return block_ids.long().unsqueeze(0) * kv_heads + heads.view(-1, *[1] * block_ids.dim())


# A decode group's rows have context lengths within this factor of its shortest one...
_GROUP_LEN_RATIO = 1.25
# ...and its gathered K and V together stay under about this many bytes.
_GROUP_BYTES = 1 << 20


def _decode_groups(
    meta: DecodeMeta, kv_heads: int, block_size: int, token_bytes: int
) -> list[_DecodeGroup]:
    """Cut the decode rows (sorted by context length) into groups of one SDPA call each.

    A group is padded to its longest row, so a wide spread of lengths gathers and
    attends to padding for nothing; and a group whose gathered K/V outgrow the core's
    L2 cache makes SDPA read them back from memory. Measured on the `varied` workload's
    shapes (64 rows, contexts 16-768): cutting where the length doubled, with no size
    limit, took 2-3x longer per layer than cutting at 1.25x and ~1 MiB per group.
    `token_bytes` is one token's K plus V for all KV heads of a layer.
    """
    lens = meta.context_lens_list
    groups, start = [], 0
    for end in range(1, len(lens) + 1):
        if end < len(lens):
            padded = (end + 1 - start) * _round_up(lens[end], block_size) * token_bytes
            if lens[end] <= _GROUP_LEN_RATIO * max(lens[start], block_size) and (
                padded <= _GROUP_BYTES
            ):
                continue
        num_blocks = -(-lens[end - 1] // block_size)
        tables = meta.block_tables[start:end, :num_blocks]
        positions = torch.arange(num_blocks * block_size, device=tables.device)
        mask = positions.unsqueeze(0) < meta.context_lens[start:end].unsqueeze(1)
        groups.append(
            _DecodeGroup(
                rows=slice(start, end),
                block_rows=_block_rows(tables, kv_heads).view(-1),
                num_blocks=num_blocks,
                mask=mask.view(end - start, 1, 1, -1),
            )
        )
        start = end
    return groups


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: index_copy into the cache, gather whole blocks, SDPA.

    With an 8-bit cache it quantizes the rows it writes and dequantizes what it gathers;
    a prefill chunk attends to its own fresh K/V rounded through the format, so every
    token is seen as the cache holds it (engine/modeling/kv_quant.py, "What attention sees").
    """

    name = "torch"

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        self.kv_cache_dtype = kv_cache_dtype
        self._quantized = kv_quant.is_quantized(kv_cache_dtype)

    def _values(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gathered cache rows as K/V values of `dtype` (a no-op for an unquantized cache)."""
        if not self._quantized:
            return rows
        return kv_quant.dequantize(rows, self.kv_cache_dtype, dtype)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        kv_heads, block_size, row = k_cache.shape[1:]  # row: head_dim, or its 8-bit bytes
        # the gathered K/V of a decode group are values of q's dtype either way
        token_bytes = 2 * kv_heads * q.shape[-1] * q.element_size()
        plan = self._plan(meta, kv_heads, block_size, token_bytes)
        k_rows, v_rows = k, v
        if self._quantized:
            k_rows = kv_quant.quantize(k, self.kv_cache_dtype)
            v_rows = kv_quant.quantize(v, self.kv_cache_dtype)
            if meta.prefills:  # a chunk sees its own tokens as the cache holds them
                k, v = self._values(k_rows, k.dtype), self._values(v_rows, v.dtype)
        k_cache.view(-1, row).index_copy_(0, plan["write"], k_rows.reshape(-1, row))
        v_cache.view(-1, row).index_copy_(0, plan["write"], v_rows.reshape(-1, row))
        if not meta.prefills and meta.decode is not None:  # a decode-only step: no copy
            return self._decode_rows(q, kv_cache, meta.decode, plan, scale)
        out = torch.empty_like(q)
        if meta.prefills:
            self._prefill_rows(q, k, v, kv_cache, meta, plan, scale, out)
        if meta.decode is not None:
            start = meta.num_prefill_tokens
            out[start:] = self._decode_rows(q[start:], kv_cache, meta.decode, plan, scale)
        return out

    def _prefill_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        plan: dict[str, Any],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Write the prefill rows' attention output into `out[:num_prefill_tokens]`; the
        chunks' own K/V are in the cache already (`k`, `v`: as attention sees them)."""
        row = kv_cache[0].shape[-1]
        block_size = kv_cache[0].shape[2]
        k_blocks = kv_cache[0].view(-1, block_size, row)  # [blocks * KVH, bs, row]
        v_blocks = kv_cache[1].view(-1, block_size, row)
        for p, rows in zip(meta.prefills, plan["prefill"], strict=True):
            sl = slice(p.query_start, p.query_start + p.query_len)
            out[sl] = _prefill(
                q[sl], k[sl], v[sl], k_blocks, v_blocks, rows, p, scale, self._values
            )

    def _decode_rows(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        decode: DecodeMeta,
        plan: dict[str, Any],
        scale: float,
    ) -> torch.Tensor:
        """Attention output [B, H, D] of the decode rows `q` [B, H, D]."""
        k_cache, v_cache = kv_cache
        shape = (-1, *k_cache.shape[2:])  # [blocks * KVH, bs, row]
        k_blocks, v_blocks = k_cache.view(shape), v_cache.view(shape)
        out = torch.empty_like(q)
        for g in plan["decode"]:
            out[g.rows] = _decode(q[g.rows], k_blocks, v_blocks, g, scale, self._values)
        return out

    def _decode_groups(
        self, decode: DecodeMeta, kv_heads: int, block_size: int, token_bytes: int
    ) -> list[_DecodeGroup]:
        return _decode_groups(decode, kv_heads, block_size, token_bytes)

    def _plan(
        self, meta: AttentionMetadata, kv_heads: int, block_size: int, token_bytes: int
    ) -> dict[str, Any]:
        plan: dict[str, Any] | None = meta.scratch.get("torch")
        if plan is None:
            slots = meta.slot_mapping
            offsets = slots % block_size
            # row of (token, head) in the cache viewed as [blocks * KVH * bs, D]
            base = (slots - offsets) * kv_heads + offsets
            heads = torch.arange(kv_heads, device=slots.device) * block_size
            plan = {
                "write": (base.unsqueeze(1) + heads).view(-1),
                "prefill": [
                    _block_rows(p.block_table, kv_heads) if p.context_len > p.query_len else None
                    for p in meta.prefills
                ],
                "decode": (
                    self._decode_groups(meta.decode, kv_heads, block_size, token_bytes)
                    if meta.decode
                    else []
                ),
            }
            meta.scratch["torch"] = plan
        return plan


# gathered cache rows -> K/V values of a dtype (TorchAttentionBackend._values)
_Values = Callable[[torch.Tensor, torch.dtype], torch.Tensor]


def _prefill(
    q: torch.Tensor,  # [S, H, D]
    k: torch.Tensor,  # [S, KVH, D]
    v: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_rows: torch.Tensor | None,  # [KVH, num_blocks]
    p: PrefillMeta,
    scale: float,
    values: _Values,
) -> torch.Tensor:
    if block_rows is None:  # no cached prefix: attend to the chunk itself
        mask = None
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, S, D]
    else:
        kv_heads, row = block_rows.shape[0], k_blocks.shape[-1]
        k = k_blocks.index_select(0, block_rows.view(-1)).view(kv_heads, -1, row)
        v = v_blocks.index_select(0, block_rows.view(-1)).view(kv_heads, -1, row)
        k, v = k[:, : p.context_len], v[:, : p.context_len]  # [KVH, C, row]
        k, v = values(k, q.dtype), values(v, q.dtype)  # [KVH, C, D]
        # query i sits at absolute position (C - S + i) and sees keys j <= that.
        offset = p.context_len - p.query_len
        mask = torch.ones(p.query_len, p.context_len, dtype=torch.bool, device=q.device)
        mask = mask.tril(diagonal=offset)
    groups = q.shape[1] // k.shape[0]
    if groups > 1:
        # NOTE: enable_gqa sends SDPA down its unfused math path on CPU (bmm + softmax);
        # repeating K/V per query head keeps the fused kernel (docs/measurements.md).
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    # NOTE: 4-D inputs: SDPA's fused CPU kernel does not take 3-D ones.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, S, D]
        k.unsqueeze(0),  # [1, H, C, D]
        v.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )
    return out[0].transpose(0, 1)


def _decode(
    q: torch.Tensor,  # [b, H, D]
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    g: _DecodeGroup,
    scale: float,
    values: _Values,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    kv_heads = g.block_rows.numel() // (batch * g.num_blocks)
    row = k_blocks.shape[-1]
    # [KVH, b, L, D] -> [b, KVH, L, D]: each (L, D) slab stays contiguous for SDPA.
    k = k_blocks.index_select(0, g.block_rows).view(kv_heads, batch, -1, row)
    v = v_blocks.index_select(0, g.block_rows).view(kv_heads, batch, -1, row)
    k, v = values(k, q.dtype), values(v, q.dtype)
    # NOTE: query heads of one KV group ride as G "query positions" of that KV head
    # (heads h = kv * G + g, as transformers' repeat_kv orders them).
    groups = num_heads // kv_heads
    q = q.view(batch, kv_heads, groups, head_dim)  # [b, KVH, G, D]
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [b, KVH, L, D]
    # Without the GQA flag SDPA takes its fused CPU kernel (docs/measurements.md).
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with attention on the compiled CPU kernels (`cpu_kernels`).

    Decode rows read K/V straight from their blocks, with no gathered copy (an 8-bit
    cache's rows are dequantized as the kernel reads them). Prefill chunks of every
    sequence in the step go to the prefill kernel in one call, which also reads their
    cached prefix in place; an 8-bit cache or a head_dim it does not take keeps SDPA for
    prefill. Chosen only for a dtype and KV cache format the decode kernel takes
    (`make_attention_backend`).
    """

    name = "cpu"

    def __init__(self, kernels: CpuKernels, kv_cache_dtype: str = "auto") -> None:
        super().__init__(kv_cache_dtype)
        self.kernels = kernels
        # the prefill kernel takes the chunks as one PrefillBatch
        self.wants_prefill_batch = not self._quantized

    @property
    def cpu_kernels(self) -> CpuKernels | None:
        return self.kernels

    def _prefill_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        plan: dict[str, Any],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        batch = meta.prefill_batch
        if batch is None or not self.kernels.takes_prefill(
            q.dtype, q.shape[-1], self.kv_cache_dtype
        ):
            super()._prefill_rows(q, k, v, kv_cache, meta, plan, scale, out)
            return
        n = meta.num_prefill_tokens
        self.kernels.paged_prefill(
            q[:n].contiguous(),
            kv_cache[0],
            kv_cache[1],
            batch.block_tables,
            batch.query_start_loc,
            batch.context_lens,
            scale,
            out=out[:n],
            num_threads=torch.get_num_threads(),
        )

    def _decode_rows(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        decode: DecodeMeta,
        plan: dict[str, Any],
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        return self.kernels.paged_decode(
            q.contiguous(),
            k_cache,
            v_cache,
            decode.block_tables,
            decode.context_lens,
            scale,
            num_threads=torch.get_num_threads(),
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def _decode_groups(
        self, decode: DecodeMeta, kv_heads: int, block_size: int, token_bytes: int
    ) -> list[_DecodeGroup]:
        return []  # the kernel needs no groups
