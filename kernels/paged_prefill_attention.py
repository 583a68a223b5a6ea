"""Paged prefill attention: causal attention of new (chunked-prefill) tokens over a paged cache.

What it computes: sequence s owns the query rows query_start_loc[s]:query_start_loc[s+1]
(its Q = query_len_s new tokens) and its keys/values are the first N = context_lens[s]
tokens of its blocks: the cached prefix plus the new tokens, which the caller has
already written into the cache. New token i sits at absolute position N - Q + i and
attends to keys j <= N - Q + i:
    out[t, h] = softmax(scale * q[t, h] @ K_s[g]^T + causal mask) @ V_s[g],  g = h // (H // KVH)
(the GQA order of transformers' `repeat_kv`). No prefix (N == Q) is plain causal
attention; a prefix hit or a chunk in the middle of a prompt (N > Q) sees the whole
prefix.

Memory layout (one layer, the engine's convention, see `engine/modeling/attention.py`):
    q                [T, H, D]             fp16 / bf16 / fp32, any strides; T = sum of Q
    k/v_cache        [num_blocks, KVH, block_size, D], same dtype as q, any strides;
                     or 8-bit (`kv_cache_dtype` "int8" / "fp8", engine/modeling/kv_quant.py):
                     [num_blocks, KVH, block_size, D + 2] uint8 rows, D codes + a bf16 scale
    block_tables     [S, max_blocks] int32 entries past a sequence's end are never read
    query_start_loc  [S + 1] int32         cumulative query lengths, starting at 0
    context_lens     [S] int32             N per sequence, N >= Q (not checked: it would sync)
    out              [T, H, D]             dtype of q, contiguous

Algorithm: one program per (query tile of BLOCK_M rows, sequence, query head); programs
whose tile starts past their sequence's Q return at once (the grid is sized by the
longest Q). Each walks the keys 0 .. (last row's position) in tiles of BLOCK_N,
gathering every key's block id from the block table (a tile may straddle pages), and keeps
an online softmax in fp32. The causal mask is applied to every tile (cheap next to the
dots); prefix tiles could skip it, a possible optimisation. K/V are re-read once per
query head of a GQA group: prefill is compute-bound, so this trades a little bandwidth
for a simple grid. An 8-bit cache is dequantized as it is read, as in the decode kernel
(kernels/paged_decode_attention.py, kernels/_kv8.py): the chunk's own new tokens too, read
back from the cache, so they are seen as the cache holds them (engine/modeling/kv_quant.py).

Limits: D <= 256 (padded to a power of two >= 16 and masked, so 40, 80, 96 work); any
block size (tested with powers of two); exp2 with log2(e) folded into the scale. fp32
inputs use IEEE fp32 dots (no TF32) so an fp32 model matches the torch reference;
fp16/bf16 use tensor cores with fp32 accumulation, the probabilities rounded to the input
dtype before P @ V (as FlashAttention).

Provenance: FlashAttention-2 (Dao, 2023) forward pass after the Triton tutorial
06-fused-attention, with the paged gather of vLLM's `prefix_prefill` / unified Triton
attention kernels (token-granular block-table lookups).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve.kernels import _kv8
from pdserve.kernels._checks import check_attention_inputs, check_device
from pdserve.kernels._variants import launch

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_MIN_DOT = 16  # tl.dot needs every dimension >= 16
# (largest query tile, key tile, warps) by dtype: the largest tiles ptxas fits in registers
# without spilling at D=128 on sm_90a (Triton 3.9, `ptxas -v`); fp32's IEEE dots are FMA
# loops and need more registers than tensor-core MMAs. Not yet tuned by timing on a GPU.
_TILES = {torch.float32: (32, 32, 8), torch.float16: (64, 64, 8), torch.bfloat16: (64, 64, 8)}


# The block table's row stride is its width, which follows the step's longest context:
# Triton's own specialisation of it (== 1, divisible by 16) would make a variant per kind
# of width (kernels/_variants.py). Every other stride is fixed for an engine's life.
@triton.jit(do_not_specialize=["stride_bt_s"])
def _paged_prefill_kernel(  # type: ignore[no-untyped-def]  # Triton args stay unannotated
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    qk_scale,  # scale * log2(e)
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_blk,
    stride_k_head,
    stride_k_tok,
    stride_k_d,
    stride_v_blk,
    stride_v_head,
    stride_v_tok,
    stride_v_d,
    stride_bt_s,
    stride_bt_blk,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,  # 0: K/V of q's dtype; 1 / 2: int8 / e4m3 rows (kernels/_kv8.py)
    FP8_NATIVE: tl.constexpr,  # e4m3 codes through Triton's float8e4nv (sm_89+, interpreter)
):
    tile_m = tl.program_id(0) * BLOCK_M
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP_SIZE

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if tile_m >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    offs_m = tile_m + tl.arange(0, BLOCK_M)  # query index within the sequence's chunk
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < query_len
    mask_d = offs_d < HEAD_DIM
    # Absolute positions; padding rows (offs_m >= Q) land at >= N and are never stored.
    positions = context_len - query_len + offs_m

    rows = query_start + offs_m
    q_ptrs = q_ptr + rows[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :] * stride_q_d
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_head_ptr = k_cache_ptr + kv_head * stride_k_head
    v_head_ptr = v_cache_ptr + kv_head * stride_v_head
    bt_ptr = block_tables_ptr + seq * stride_bt_s
    # Keys past the tile's last position are masked for every row: stop there.
    kv_end = tl.minimum(context_len, context_len - query_len + tile_m + BLOCK_M)
    # NOTE: the first tile holds key 0, which every row sees, so the running max is finite
    # from then on and exp2(-inf - m) never sees -inf - -inf in later, masked tiles.
    for tile_start in range(0, kv_end, BLOCK_N):
        offs_tok = tile_start + offs_n
        mask_n = offs_tok < kv_end
        # int64: block_id * stride_k_blk overflows int32 for caches over 2 GiB elements.
        block_ids = tl.load(bt_ptr + (offs_tok // BLOCK_SIZE) * stride_bt_blk, mask=mask_n, other=0)
        block_ids = block_ids.to(tl.int64)
        offs_in_block = offs_tok % BLOCK_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_rows = k_head_ptr + block_ids * stride_k_blk + offs_in_block * stride_k_tok  # [BLOCK_N]
        k_ptrs = k_rows[:, None] + offs_d[None, :] * stride_k_d
        if KV_QUANT:
            k_codes = tl.load(k_ptrs, mask=kv_mask, other=0)  # [BLOCK_N, BLOCK_D] uint8
            k = _kv8.codes_to(k_codes, KV_QUANT, FP8_NATIVE, q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
            qk = qk * _kv8.row_scales(k_rows, HEAD_DIM, stride_k_d, mask_n)[None, :] * qk_scale
        else:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        causal = (offs_tok[None, :] <= positions[:, None]) & mask_n[None, :]
        qk = tl.where(causal, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_rows = v_head_ptr + block_ids * stride_v_blk + offs_in_block * stride_v_tok
        v_ptrs = v_rows[:, None] + offs_d[None, :] * stride_v_d
        if KV_QUANT:
            v_codes = tl.load(v_ptrs, mask=kv_mask, other=0)
            v = _kv8.codes_to(v_codes, KV_QUANT, FP8_NATIVE, q.dtype)
            pv = p * _kv8.row_scales(v_rows, HEAD_DIM, stride_v_d, mask_n)[None, :]
        else:
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            pv = p
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :] * stride_o_d
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D]
    v_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    context_lens: torch.Tensor,  # [S] int32
    scale: float,
    max_query_len: int | None = None,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged cache (prefix included).

    Args:
        q: the new tokens' queries of all sequences, flat, [T, H, D].
        k_cache, v_cache: one layer's paged cache, [num_blocks, KVH, block_size, D], same
            dtype and device as `q` (8-bit: uint8 [..., D + 2]), already holding the new
            tokens' K/V.
        block_tables: int32 [S, max_blocks], the physical block ids of each sequence.
        query_start_loc: int32 [S + 1], sequence s owns rows [qsl[s], qsl[s + 1]).
        context_lens: int32 [S], tokens of each sequence in the cache (prefix + new);
            must be >= its query length and <= max_blocks * block_size (not checked).
        scale: softmax scale, usually D ** -0.5.
        max_query_len: the longest query length, if the caller knows it; None reads it
            from `query_start_loc` (one device sync).
        kv_cache_dtype: "auto" (the cache holds q's dtype), or "int8" / "fp8": rows of
            D codes and their bfloat16 scale (engine/modeling/kv_quant.py).

    Returns:
        [T, H, D] in q's dtype.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, kv_cache_dtype)
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if max_query_len <= 0:
        return out
    _, block_n, num_warps = _TILES[q.dtype]
    block_m = _block_m(max_query_len, q.dtype)

    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    launch(
        _paged_prefill_kernel,
        grid,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale * math.log2(math.e),
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        HEAD_DIM=head_dim,
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        GROUP_SIZE=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # IEEE fp32 dots for fp32 (TF32 would cost an fp32 model its exactness); the
        # backend's default for fp16/bf16, where precision options do not apply.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        KV_QUANT=_kv8.KV_QUANT[kv_cache_dtype],
        FP8_NATIVE=_kv8.fp8_native(q.device),
        enable_fp_fusion=True,  # FMAs; explicit because Triton 3.10 flips the default
        num_warps=num_warps,
    )
    return out


def _block_m(max_query_len: int, dtype: torch.dtype) -> int:
    """The query tile: the longest query's length rounded up to a power of two, at least
    tl.dot's 16 and at most the dtype's tile, so a few variants serve every length."""
    return min(_TILES[dtype][0], max(_MIN_DOT, triton.next_power_of_2(max_query_len)))


def query_len_buckets(dtype: torch.dtype) -> tuple[int, ...]:
    """The shortest longest-query length of each BLOCK_M `_block_m` picks for `dtype`."""
    lens = [1]
    block_m = _MIN_DOT
    while block_m < _TILES[dtype][0]:
        lens.append(block_m + 1)
        block_m *= 2
    return tuple(lens)


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    kv_cache_dtype: str,
) -> None:
    check_attention_inputs(q, k_cache, v_cache, _SUPPORTED_DTYPES, _MAX_HEAD_DIM, kv_cache_dtype)
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    if context_lens.dtype != torch.int32 or num_seqs < 0:
        raise ValueError(
            f"context_lens must be int32 [num_seqs], got {context_lens.dtype} "
            f"{tuple(context_lens.shape)}"
        )
    if query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be int32 [{num_seqs + 1}], got {query_start_loc.dtype} "
            f"{tuple(query_start_loc.shape)}"
        )
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be int32 [num_seqs, max_blocks], got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    check_device(
        _paged_prefill_kernel,
        "ref_paged_prefill_attention",
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
    )


def ref_paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    query_start_loc: torch.Tensor,  # [S + 1]
    context_lens: torch.Tensor,  # [S]
    scale: float,
) -> torch.Tensor:
    """Torch reference: gather each sequence's K/V, offset causal mask, fp32 softmax."""
    num_heads = q.shape[1]
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    group_size = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, n in enumerate(context_lens.tolist()):
        rows = slice(starts[s], starts[s + 1])
        query_len = starts[s + 1] - starts[s]
        num_blocks = triton.cdiv(n, block_size)
        blocks = block_tables[s, :num_blocks].long()
        # [nb, KVH, bs, D] -> [KVH, nb * bs, D] -> first n tokens -> [H, n, D]
        shape = (num_kv_heads, num_blocks * block_size, head_dim)
        k = k_cache[blocks].transpose(0, 1).reshape(shape)[:, :n]
        v = v_cache[blocks].transpose(0, 1).reshape(shape)[:, :n]
        k = k.float().repeat_interleave(group_size, dim=0)
        v = v.float().repeat_interleave(group_size, dim=0)
        positions = torch.arange(n - query_len, n, device=q.device)  # [Q]
        visible = torch.arange(n, device=q.device)[None, :] <= positions[:, None]  # [Q, n]
        scores = torch.einsum("qhd,hnd->hqn", q[rows].float(), k) * scale  # [H, Q, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("hqn,hnd->qhd", probs, v).to(q.dtype)
    return out
