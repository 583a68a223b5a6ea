"""The Triton attention backend of the engine: reshape_and_cache + paged attention.

With it the model also runs RMSNorm (residual add fused) and rotary embedding in their
Triton kernels (`engine/modeling/ops.py`), and on CUDA decode steps replay as CUDA graphs
(`engine/worker/cuda_graphs.py`).

Selected automatically on CUDA (`EngineConfig.attention_backend="auto"`), or explicitly
with `"triton"`. On CPU it runs only under `TRITON_INTERPRET=1` (tests); the torch
backend (`engine/modeling/attention.py`) is the CPU path. Outputs equal the torch backend's up
to float rounding (tests/kernels/test_backend.py), with an 8-bit KV cache too
(`kv_cache_dtype` int8 / fp8, engine/modeling/kv_quant.py): `reshape_and_cache` writes the rows
kv_quant.quantize would, byte for byte, and both attention kernels dequantize the rows as
they read them, the chunk's own fresh tokens included.
"""

from __future__ import annotations

import torch

from pdserve.engine.modeling.attention import AttentionBackend, AttentionMetadata, KVCache
from pdserve.kernels.paged_decode_attention import paged_decode_attention
from pdserve.kernels.paged_prefill_attention import paged_prefill_attention
from pdserve.kernels.reshape_and_cache import reshape_and_cache


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    wants_prefill_batch = True
    uses_triton_ops = True  # the model's norms and rotary run in kernels/ too

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        self.kv_cache_dtype = kv_cache_dtype

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        kv_dtype = self.kv_cache_dtype
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, kv_dtype)
        num_prefill = meta.num_prefill_tokens
        parts = []
        if meta.prefill_batch is not None:
            batch = meta.prefill_batch
            max_query_len = max(p.query_len for p in meta.prefills)
            parts.append(
                paged_prefill_attention(
                    q[:num_prefill],
                    k_cache,
                    v_cache,
                    batch.block_tables,
                    batch.query_start_loc,
                    batch.context_lens,
                    scale,
                    max_query_len=max_query_len,
                    kv_cache_dtype=kv_dtype,
                )
            )
        if meta.decode is not None:
            decode = meta.decode
            parts.append(
                paged_decode_attention(
                    q[num_prefill:],
                    k_cache,
                    v_cache,
                    decode.block_tables,
                    decode.context_lens,
                    scale,
                    kv_cache_dtype=kv_dtype,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)
