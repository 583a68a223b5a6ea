"""Paged decode attention: one new query token per sequence over its paged KV cache.

What it computes: for each sequence b and query head h,
    out[b, h] = softmax(scale * q[b, h] @ K_b[g]^T) @ V_b[g],   g = h // (H // KVH)
where K_b, V_b are the first `context_lens[b]` tokens of sequence b, found through its
block table (the GQA order of transformers' `repeat_kv`).

Memory layout (one layer, the engine's convention, see `engine/modeling/attention.py`):
    q             [B, H, D]                  fp16 / bf16 / fp32, any strides
    k/v_cache     [num_blocks, KVH, block_size, D], same dtype as q, any strides;
                  or 8-bit (`kv_cache_dtype` "int8" / "fp8", engine/modeling/kv_quant.py):
                  [num_blocks, KVH, block_size, D + 2] uint8 rows, D codes + a bf16 scale
    block_tables  [B, max_blocks] int32      entries past a sequence's end may be any
                                             valid block id (never read)
    context_lens  [B] int32                  tokens attended to, the new one included
    out           [B, H, D]                  dtype of q, contiguous

Algorithm: one program per (sequence, kv head, split). The program loads the G = H / KVH
query heads of its group as one [BLOCK_G, BLOCK_D] tile (G padded to >= 16 so the scores
are a `tl.dot`), so K/V are read once per group, not once per query head. It walks its
tokens in tiles of BLOCK_N, gathering each token's block id from the block table (a tile
may straddle pages; the block size is independent of BLOCK_N), and keeps an online
softmax in fp32 (running max, running sum, unnormalised accumulator).
An 8-bit cache is dequantized as it is read (kernels/_kv8.py): the codes convert to q's
dtype exactly, the dot takes them, and each token's scale multiplies its column of
scores (K) and of probabilities (V, before they round to q's dtype for P @ V); its rows
are 2-byte aligned, so the code loads are bytewise (kernels/_kv8.py says what that costs).
With one split the program normalises and writes `out`. With NUM_SPLITS > 1
(flash-decoding split-K) each sequence's context is cut into NUM_SPLITS page-aligned
ranges, each program writes its partial (max, sum, acc) in fp32 to a scratch buffer, and
`_reduce_splits_kernel` merges them. Splits help when B * KVH programs cannot fill the
GPU (small batch, long context); the split ranges are derived per sequence inside the
kernel, so the launcher never syncs with the device to read context lengths.

Limits: D <= 256 (padded to a power of two >= 16 and masked, so 40, 80, 96 work); any
block size (tested with powers of two); context_lens[b] == 0 gives a zero row; scores use
exp2 with log2(e) folded into the scale. fp32 inputs use IEEE fp32 dots (no TF32) so an
fp32 model matches the torch reference; fp16/bf16 use tensor cores with fp32
accumulation, the probabilities rounded to the input dtype before P @ V (as FlashAttention).

Provenance: split-K decoding after Dao et al., "Flash-Decoding for long-context
inference" (2023) and the Triton decode kernels of LightLLM / SGLang / vLLM's paged
attention; online softmax after FlashAttention (Dao et al., 2022) and the Triton tutorial
06-fused-attention.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from pdserve.kernels import _kv8
from pdserve.kernels._checks import check_attention_inputs, check_device
from pdserve.kernels._variants import launch

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
# Tokens per tile and warps, by dtype: the largest tiles ptxas fits in registers without
# spilling at D=128 on sm_90a (Triton 3.9, `ptxas -v`); fp32's IEEE dots are FMA loops and
# need more registers than tensor-core MMAs. Not yet tuned by timing on a GPU.
_TILES = {torch.float32: (32, 8), torch.float16: (32, 4), torch.bfloat16: (32, 4)}
_MIN_DOT = 16  # tl.dot needs every dimension >= 16
# Auto split-K: aim for a few programs per SM, never below this many tokens per split;
# rounded down to a power of two (each split count is a variant to compile: few of them).
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32  # a power of two
_PROGRAMS_PER_SM = 2
_CPU_SM_COUNT = 8  # stand-in SM count for the interpreter, where there is no GPU to ask


# The block table's row stride is its width, which follows the step's longest context:
# Triton's own specialisation of it (== 1, divisible by 16) would make a variant per kind
# of width (kernels/_variants.py). Every other stride is fixed for an engine's life.
@triton.jit(do_not_specialize=["stride_bt_b"])
def _paged_decode_kernel(  # type: ignore[no-untyped-def]  # Triton args stay unannotated
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_m_ptr,  # [B, H, NUM_SPLITS] fp32 running max (log2 units); unused with 1 split
    part_l_ptr,  # [B, H, NUM_SPLITS] fp32 running sum
    part_acc_ptr,  # [B, H, NUM_SPLITS, D] fp32 unnormalised accumulator
    qk_scale,  # scale * log2(e)
    stride_q_b,
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
    stride_bt_b,
    stride_bt_blk,
    stride_o_b,
    stride_o_h,
    stride_o_d,
    stride_pm_b,
    stride_pm_h,
    stride_pm_s,
    stride_pa_b,
    stride_pa_h,
    stride_pa_s,
    stride_pa_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,  # 0: K/V of q's dtype; 1 / 2: int8 / e4m3 rows (kernels/_kv8.py)
    FP8_NATIVE: tl.constexpr,  # e4m3 codes through Triton's float8e4nv (sm_89+, interpreter)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP_SIZE
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP_SIZE + offs_g  # query heads of this kv head's group

    q_ptrs = q_ptr + seq * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :] * stride_q_d
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    # This split's token range [start, end): page-aligned, computed from this sequence's
    # own length, so short sequences in a long batch leave their last splits empty.
    context_len = tl.load(context_lens_ptr + seq)
    tokens_per_split = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_SIZE) * BLOCK_SIZE
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_head_ptr = k_cache_ptr + kv_head * stride_k_head
    v_head_ptr = v_cache_ptr + kv_head * stride_v_head
    bt_ptr = block_tables_ptr + seq * stride_bt_b
    # NOTE: every tile holds >= 1 unmasked token (tiles start below `end`), so the running
    # max is finite after the first tile and exp2(-inf - m) never sees -inf - -inf.
    for tile_start in range(start, end, BLOCK_N):
        offs_tok = tile_start + offs_n
        mask_n = offs_tok < end
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
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
            qk = qk * _kv8.row_scales(k_rows, HEAD_DIM, stride_k_d, mask_n)[None, :] * qk_scale
        else:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))

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

    out_mask = mask_g[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # empty context: a zero row
        o_ptrs = (
            out_ptr + seq * stride_o_b + heads[:, None] * stride_o_h + offs_d[None, :] * stride_o_d
        )
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        pm_offs = seq * stride_pm_b + heads * stride_pm_h + split * stride_pm_s
        tl.store(part_m_ptr + pm_offs, m_i, mask=mask_g)
        tl.store(part_l_ptr + pm_offs, l_i, mask=mask_g)
        pa_ptrs = (
            part_acc_ptr
            + seq * stride_pa_b
            + heads[:, None] * stride_pa_h
            + split * stride_pa_s
            + offs_d[None, :] * stride_pa_d
        )
        tl.store(pa_ptrs, acc, mask=out_mask)


@triton.jit
def _reduce_splits_kernel(  # type: ignore[no-untyped-def]  # Triton args stay unannotated
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    stride_pm_b,
    stride_pm_h,
    stride_pm_s,
    stride_pa_b,
    stride_pa_h,
    stride_pa_s,
    stride_pa_d,
    stride_o_b,
    stride_o_h,
    stride_o_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Merges the splits of one (sequence, query head): rescale each to the global max."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM

    pm_ptrs = seq * stride_pm_b + head * stride_pm_h + offs_s * stride_pm_s
    m = tl.load(part_m_ptr + pm_ptrs, mask=mask_s, other=float("-inf"))  # [BLOCK_S]
    l_s = tl.load(part_l_ptr + pm_ptrs, mask=mask_s, other=0.0)
    pa_ptrs = (
        part_acc_ptr
        + seq * stride_pa_b
        + head * stride_pa_h
        + offs_s[:, None] * stride_pa_s
        + offs_d[None, :] * stride_pa_d
    )
    acc = tl.load(pa_ptrs, mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]

    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: weights 0
    weights = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    l_total = tl.sum(weights * l_s, 0)
    o = tl.sum(weights[:, None] * acc, 0) / tl.where(l_total == 0.0, 1.0, l_total)
    o_ptrs = out_ptr + seq * stride_o_b + head * stride_o_h + offs_d * stride_o_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_d)


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D]
    v_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    num_splits: int | None = None,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged KV cache.

    Args:
        q: the new token's queries, [B, H, D].
        k_cache, v_cache: one layer's paged cache, [num_blocks, KVH, block_size, D],
            same dtype and device as `q` (8-bit: uint8 [..., D + 2]); H must be a
            multiple of KVH.
        block_tables: int32 [B, max_blocks], the physical block ids of each sequence.
        context_lens: int32 [B], tokens attended to per sequence (the new one included);
            must not exceed max_blocks * block_size (not checked: it would sync).
        scale: softmax scale, usually D ** -0.5.
        num_splits: split-K factor; None picks one from batch size and the longest
            context the block tables can describe (no device sync), a power of two up to
            32 (`_auto_num_splits`); 1 disables split-K.
        kv_cache_dtype: "auto" (the cache holds q's dtype), or "int8" / "fp8": rows of
            D codes and their bfloat16 scale (engine/modeling/kv_quant.py).

    Returns:
        [B, H, D] in q's dtype.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, kv_cache_dtype)
    if num_splits is not None and (isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group_size = num_heads // num_kv_heads
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = _auto_num_splits(batch * num_kv_heads, max_context, q.device)

    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
    else:  # never touched: the kernel writes `out` directly
        part_m = part_l = part_acc = out

    block_n, num_warps = _TILES[q.dtype]
    grid = (batch, num_kv_heads, num_splits)
    launch(
        _paged_decode_kernel,
        grid,
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_m,
        part_l,
        part_acc,
        scale * math.log2(math.e),
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        *_strides(part_m, 3, num_splits),
        *_strides(part_acc, 4, num_splits),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        GROUP_SIZE=group_size,
        BLOCK_G=max(_MIN_DOT, triton.next_power_of_2(group_size)),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        # IEEE fp32 dots for fp32 (TF32 would cost an fp32 model its exactness); the
        # backend's default for fp16/bf16, where precision options do not apply.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        KV_QUANT=_kv8.KV_QUANT[kv_cache_dtype],
        FP8_NATIVE=_kv8.fp8_native(q.device),
        enable_fp_fusion=True,  # FMAs; explicit because Triton 3.10 flips the default
        num_warps=num_warps,
    )
    if num_splits > 1:
        launch(
            _reduce_splits_kernel,
            (batch, num_heads),
            part_m,
            part_l,
            part_acc,
            out,
            *part_m.stride(),
            *part_acc.stride(),
            *out.stride(),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            enable_fp_fusion=True,
        )
    return out


def _strides(t: torch.Tensor, ndim: int, num_splits: int) -> tuple[int, ...]:
    """The partial buffers' strides; zeros when there is no partial buffer (one split)."""
    return tuple(t.stride()) if num_splits > 1 else (0,) * ndim


def _auto_num_splits(num_programs: int, max_context: int, device: torch.device) -> int:
    """Enough splits to give every SM a few programs, each with a worthwhile token range,
    rounded down to a power of two: a split count per batch size and width would be a
    compile per new step shape; rounding down keeps every split worthwhile."""
    wanted = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(device), num_programs)
    worthwhile = max_context // _MIN_TOKENS_PER_SPLIT
    splits = max(1, min(wanted, worthwhile, _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


@functools.cache  # asked at every launch: no device query past the first
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return _CPU_SM_COUNT


def split_shapes(
    num_kv_heads: int,
    block_size: int,
    max_blocks: int,
    max_rows: int | None,
    device: torch.device,
) -> dict[int, tuple[int, int]]:
    """For each split count `_auto_num_splits` can pick for launches of at most `max_rows`
    rows (None: any) and `max_blocks` block-table columns, one (rows, width) that picks it.

    The count is the smaller of a term falling with the rows and one rising with the
    width: the smallest rows (width) giving each value of its term, paired, reach them all.
    """

    def splits(rows: int, width: int) -> int:
        return _auto_num_splits(rows * num_kv_heads, width * block_size, device)

    # past this many rows the programs alone fill the device: one split, as at this many
    filling = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(device), num_kv_heads)
    rows_limit = filling if max_rows is None else min(max_rows, filling)
    by_rows = _smallest_per_value(rows_limit, lambda rows: splits(rows, max_blocks))
    by_width = _smallest_per_value(max_blocks, lambda width: splits(1, width))
    shapes: dict[int, tuple[int, int]] = {}
    for rows in by_rows.values():
        for width in by_width.values():
            shapes.setdefault(splits(rows, width), (rows, width))
    return shapes


def _smallest_per_value(limit: int, splits_of: Callable[[int], int]) -> dict[int, int]:
    """The smallest n in [1, limit] giving each value of `splits_of` (monotone in n)."""
    smallest: dict[int, int] = {}
    for n in range(1, limit + 1):
        smallest.setdefault(splits_of(n), n)
    return smallest


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_cache_dtype: str,
) -> None:
    check_attention_inputs(q, k_cache, v_cache, _SUPPORTED_DTYPES, _MAX_HEAD_DIM, kv_cache_dtype)
    batch = q.shape[0]
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be int32 [batch, max_blocks], got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (batch,):
        raise ValueError(
            f"context_lens must be int32 [{batch}], got {context_lens.dtype} "
            f"{tuple(context_lens.shape)}"
        )
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for a batch of {batch}")
    check_device(
        _paged_decode_kernel,
        "ref_paged_decode_attention",
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
    )


def ref_paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:
    """Torch reference: gather each sequence's K/V, fp32 softmax, output in q's dtype."""
    num_heads = q.shape[1]
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    group_size = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for b, n in enumerate(context_lens.tolist()):
        num_blocks = triton.cdiv(n, block_size)
        blocks = block_tables[b, :num_blocks].long()
        # [nb, KVH, bs, D] -> [KVH, nb * bs, D] -> first n tokens -> [H, n, D]
        rows = (num_kv_heads, num_blocks * block_size, head_dim)
        k = k_cache[blocks].transpose(0, 1).reshape(rows)[:, :n]
        v = v_cache[blocks].transpose(0, 1).reshape(rows)[:, :n]
        k = k.float().repeat_interleave(group_size, dim=0)
        v = v.float().repeat_interleave(group_size, dim=0)
        scores = torch.einsum("hd,hnd->hn", q[b].float(), k) * scale  # [H, n]
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,hnd->hd", probs, v).to(q.dtype)
    return out
