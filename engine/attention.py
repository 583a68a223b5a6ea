"""Attention over a paged KV cache: the backend interface and its torch implementation.

The KV cache of one layer is a pair of tensors `[num_blocks, block_size, kv_heads,
head_dim]` (K, V). A step's tokens arrive flat: first the prefill chunks (one or more
new tokens per sequence), then the decode tokens (exactly one per sequence). The runner
builds one `AttentionMetadata` per step; every layer reuses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

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
    slots: torch.Tensor  # [B * L] int64 cache slots, padded with 0 (masked)
    mask: torch.Tensor  # [B, 1, 1, L] bool, True where attended


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    num_prefill_tokens: int
    prefills: list[PrefillMeta]
    decode: DecodeMeta | None


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
    """Reference backend: index_copy into the cache, gather by slots, SDPA."""

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
        k_flat = k_cache.view(-1, kv_heads, head_dim)  # [slots, KVH, D]
        v_flat = v_cache.view(-1, kv_heads, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for p in meta.prefills:
            rows = slice(p.query_start, p.query_start + p.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_flat, v_flat, p, scale)
        if meta.decode is not None:
            out[meta.num_prefill_tokens :] = self._decode(
                q[meta.num_prefill_tokens :], k_flat, v_flat, meta.decode, scale
            )
        return out

    @staticmethod
    def _prefill(
        q: torch.Tensor,  # [S, H, D]
        k: torch.Tensor,  # [S, KVH, D]
        v: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        p: PrefillMeta,
        scale: float,
    ) -> torch.Tensor:
        if p.context_slots is None:  # no cached prefix: attend to the chunk itself
            mask = None
        else:
            k = k_flat.index_select(0, p.context_slots)  # [C, KVH, D]
            v = v_flat.index_select(0, p.context_slots)
            # query i sits at absolute position (C - S + i) and sees keys j <= that.
            offset = p.context_len - p.query_len
            mask = torch.ones(p.query_len, p.context_len, dtype=torch.bool, device=q.device)
            mask = mask.tril(diagonal=offset)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [H, S, D]
            k.transpose(0, 1),  # [KVH, C, D]
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [B, H, D]
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        meta: DecodeMeta,
        scale: float,
    ) -> torch.Tensor:
        batch, kv_heads, head_dim = q.shape[0], k_flat.shape[1], k_flat.shape[2]
        length = meta.max_context_len
        k = k_flat.index_select(0, meta.slots).view(batch, length, kv_heads, head_dim)
        v = v_flat.index_select(0, meta.slots).view(batch, length, kv_heads, head_dim)
        # NOTE: query heads of one KV group ride as G "query positions" of that KV head
        # (heads h = kv * G + g, as transformers' repeat_kv orders them). With q_len > 1
        # and no GQA flag, SDPA takes its fused CPU kernel: 4-8x faster than enable_gqa.
        groups = q.shape[1] // kv_heads
        out = F.scaled_dot_product_attention(
            q.view(batch, kv_heads, groups, head_dim),  # [B, KVH, G, D]
            k.transpose(1, 2),  # [B, KVH, L, D]
            v.transpose(1, 2),
            attn_mask=meta.mask,  # [B, 1, 1, L]
            scale=scale,
        )
        return out.reshape(batch, kv_heads * groups, head_dim)
