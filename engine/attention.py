"""Attention over a paged KV cache: the backend interface and its torch implementation.

The KV cache of one layer is a pair of tensors `[num_blocks, kv_heads, block_size,
head_dim]` (K, V): a block is contiguous (so a transfer ships whole blocks) and within it
each head's rows are contiguous (so attention reads [tokens, head_dim] slabs). A token's
*slot* is `block_id * block_size + offset`. A step's tokens arrive flat: first the
prefill chunks (one or more new tokens per sequence), then the decode tokens (exactly
one per sequence). The runner builds one `AttentionMetadata` per step; every layer
reuses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PrefillMeta:
    """One sequence's prefill chunk inside the flat batch."""

    query_start: int  # first row of this chunk in the flat batch
    query_len: int  # new tokens in this chunk
    context_len: int  # tokens attended to: cached prefix + this chunk
    context_slots: torch.Tensor | None  # [context_len] cache slots; None when no prefix


@dataclass
class DecodeMeta:
    """The decode rows (one token per sequence) at the end of the flat batch."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, including the new token
    max_context_len: int  # L
    slots: torch.Tensor  # [B, L] int64 cache slots, padded with 0 (masked)
    mask: torch.Tensor  # [B, 1, 1, L] bool, True where attended


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    num_prefill_tokens: int
    prefills: list[PrefillMeta]
    decode: DecodeMeta | None
    # Indices a backend derives once per step and reuses in every layer.
    scratch: dict[str, Any] = field(default_factory=dict)


def cache_rows(
    slots: torch.Tensor, kv_heads: int, block_size: int, heads_first: bool = False
) -> torch.Tensor:
    """Row indices into a cache viewed as [num_blocks * kv_heads * block_size, head_dim].

    Returns [*slots.shape, kv_heads], or [kv_heads, *slots.shape] with `heads_first`.
    """
    offset = slots % block_size
    base = (slots - offset) * kv_heads + offset  # row of head 0
    heads = torch.arange(kv_heads, device=slots.device) * block_size
    if heads_first:
        return base.unsqueeze(0) + heads.view(kv_heads, *([1] * slots.dim()))
    return base.unsqueeze(-1) + heads


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and attends over it.

    Implementations: `TorchAttentionBackend` (any device) and the Triton backend of
    `pdserve.kernels` (CUDA). They must give the same outputs up to float rounding.
    """

    name: str

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


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: index_copy into the cache, gather by rows, SDPA."""

    name = "torch"

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
        kv_heads, head_dim = k.shape[1], k.shape[2]
        rows = self._rows(meta, kv_heads, k_cache.shape[2])
        k_rows = k_cache.view(-1, head_dim)  # [blocks * KVH * bs, D]
        v_rows = v_cache.view(-1, head_dim)
        k_rows.index_copy_(0, rows["write"], k.reshape(-1, head_dim))
        v_rows.index_copy_(0, rows["write"], v.reshape(-1, head_dim))
        out = torch.empty_like(q)
        for i, p in enumerate(meta.prefills):
            sl = slice(p.query_start, p.query_start + p.query_len)
            ctx = rows.get(f"prefill{i}")
            out[sl] = self._prefill(q[sl], k[sl], v[sl], k_rows, v_rows, ctx, p, scale)
        if meta.decode is not None:
            out[meta.num_prefill_tokens :] = self._decode(
                q[meta.num_prefill_tokens :], k_rows, v_rows, rows["decode"], meta.decode, scale
            )
        return out

    @staticmethod
    def _rows(meta: AttentionMetadata, kv_heads: int, block_size: int) -> dict[str, Any]:
        rows: dict[str, Any] | None = meta.scratch.get("torch_rows")
        if rows is None:
            rows = {"write": cache_rows(meta.slot_mapping, kv_heads, block_size).view(-1)}
            for i, p in enumerate(meta.prefills):
                if p.context_slots is not None:
                    rows[f"prefill{i}"] = cache_rows(p.context_slots, kv_heads, block_size, True)
            if meta.decode is not None:
                rows["decode"] = cache_rows(meta.decode.slots, kv_heads, block_size, True)
            meta.scratch["torch_rows"] = rows
        return rows

    @staticmethod
    def _prefill(
        q: torch.Tensor,  # [S, H, D]
        k: torch.Tensor,  # [S, KVH, D]
        v: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
        context_rows: torch.Tensor | None,  # [KVH, C]
        p: PrefillMeta,
        scale: float,
    ) -> torch.Tensor:
        if context_rows is None:  # no cached prefix: attend to the chunk itself
            mask = None
            k, v = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, S, D]
        else:
            kv_heads, context_len = context_rows.shape
            k = k_rows.index_select(0, context_rows.view(-1)).view(kv_heads, context_len, -1)
            v = v_rows.index_select(0, context_rows.view(-1)).view(kv_heads, context_len, -1)
            # query i sits at absolute position (C - S + i) and sees keys j <= that.
            offset = p.context_len - p.query_len
            mask = torch.ones(p.query_len, p.context_len, dtype=torch.bool, device=q.device)
            mask = mask.tril(diagonal=offset)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [H, S, D]
            k,  # [KVH, C, D]
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [B, H, D]
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
        rows: torch.Tensor,  # [KVH, B, L]
        meta: DecodeMeta,
        scale: float,
    ) -> torch.Tensor:
        kv_heads, batch, length = rows.shape
        head_dim = q.shape[-1]
        # [KVH, B, L, D] -> [B, KVH, L, D]: each (L, D) slab stays contiguous for SDPA.
        k = k_rows.index_select(0, rows.view(-1)).view(kv_heads, batch, length, head_dim)
        v = v_rows.index_select(0, rows.view(-1)).view(kv_heads, batch, length, head_dim)
        # NOTE: query heads of one KV group ride as G "query positions" of that KV head
        # (heads h = kv * G + g, as transformers' repeat_kv orders them). With q_len > 1
        # and no GQA flag, SDPA takes its fused CPU kernel: 4-8x faster than enable_gqa.
        groups = q.shape[1] // kv_heads
        out = F.scaled_dot_product_attention(
            q.view(batch, kv_heads, groups, head_dim),  # [B, KVH, G, D]
            k.transpose(0, 1),  # [B, KVH, L, D]
            v.transpose(0, 1),
            attn_mask=meta.mask,  # [B, 1, 1, L]
            scale=scale,
        )
        return out.reshape(batch, kv_heads * groups, head_dim)
