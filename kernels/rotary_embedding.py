"""Rotary position embedding (neox layout) applied to q and k, looked up by token position.

What it computes, for token t at position p = positions[t] and every head of q and of k
(x1, x2 = the first and second half of the head's row; c, s = cos[p], sin[p]):

    out[:half] = x1 * c[:half] - x2 * s[:half]
    out[half:] = x2 * c[half:] + x1 * s[half:]

i.e. the neox rotation (x * cos + rotate_half(x) * sin) with each product and the
sum rounded to the input dtype exactly as torch rounds them, so the result is bit-identical
to the reference (float fusion into fma is switched off for this reason). The scaled variants
(`linear`, `llama3`) are only different cos/sin tables: build them with
engine.rotary.cos_sin_cache. Returns NEW tensors (q_rot, k_rot); q and k are not modified,
like apply_rotary.

Memory layout:

    positions   [num_tokens] int64 (or int32)
    q           [num_tokens, num_heads, head_dim]      any strides (views of a fused qkv output)
    k           [num_tokens, num_kv_heads, head_dim]   any strides
    cos, sin    [max_positions, head_dim]   rows with repeated halves, as cos_sin_cache builds
    q_rot/k_rot contiguous, shapes and dtype of q/k

Limits: head_dim even; q, k, cos and sin share one dtype; positions are not range-checked (that
needs a device sync): a position >= max_positions reads out of bounds on a GPU. One program
per token loops over tiles of at most _MAX_TILE elements of heads x half head_dim.

Provenance: vLLM's `rotary_embedding` kernel (csrc/pos_encoding_kernels.cu: one program per
token, cos/sin cache indexed by position, neox and GPT-J variants; only neox here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import check_device
from pdserve.kernels._variants import launch

_MAX_TILE = 2048


@triton.jit
def _rotate_heads(  # type: ignore[no-untyped-def]  # Triton args stay unannotated
    in_ptr,
    out_ptr,
    stride_in_head,
    stride_in_dim,
    stride_out_head,
    num_heads,
    half_dim,
    cos1,
    cos2,
    sin1,
    sin2,
    offs_d,
    mask_d,
    BLOCK_H: tl.constexpr,
):
    """Rotate rows [num_heads, 2 * half_dim] of one token, a tile of BLOCK_H heads at a time."""
    dtype = out_ptr.dtype.element_ty
    for head_start in range(0, num_heads, BLOCK_H):
        offs_h = head_start + tl.arange(0, BLOCK_H)
        mask = (offs_h[:, None] < num_heads) & mask_d[None, :]
        row_ptr = in_ptr + offs_h[:, None] * stride_in_head
        x1 = tl.load(row_ptr + offs_d[None, :] * stride_in_dim, mask=mask, other=0.0)
        x2 = tl.load(row_ptr + (offs_d[None, :] + half_dim) * stride_in_dim, mask=mask, other=0.0)
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        # Each product rounded to the dtype, then the sum: torch's rounding points, computed in
        # float32 (exact for 16-bit products) so the interpreter never does bf16 arithmetic.
        out1 = (x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)
        out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
        out_row_ptr = out_ptr + offs_h[:, None] * stride_out_head + offs_d[None, :]
        tl.store(out_row_ptr, out1.to(dtype), mask=mask)
        tl.store(out_row_ptr + half_dim, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_embedding_kernel(  # type: ignore[no-untyped-def]  # Triton args stay unannotated
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_cos_pos,
    stride_cos_dim,
    stride_sin_pos,
    stride_sin_dim,
    stride_q_out_token,
    stride_q_out_head,
    stride_k_out_token,
    stride_k_out_head,
    num_heads,
    num_kv_heads,
    half_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < half_dim
    # Both halves are read (not just the first, though cos_sin_cache repeats it): the kernel
    # then equals apply_rotary for any table.
    cos_row = cos_ptr + position * stride_cos_pos
    sin_row = sin_ptr + position * stride_sin_pos
    cos1 = tl.load(cos_row + offs_d * stride_cos_dim, mask=mask_d, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + (offs_d + half_dim) * stride_cos_dim, mask=mask_d, other=0.0)
    sin1 = tl.load(sin_row + offs_d * stride_sin_dim, mask=mask_d, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + (offs_d + half_dim) * stride_sin_dim, mask=mask_d, other=0.0)
    cos2 = cos2.to(tl.float32)
    sin2 = sin2.to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_q_token,
        q_out_ptr + token * stride_q_out_token,
        stride_q_head,
        stride_q_dim,
        stride_q_out_head,
        num_heads,
        half_dim,
        cos1[None, :],
        cos2[None, :],
        sin1[None, :],
        sin2[None, :],
        offs_d,
        mask_d,
        BLOCK_H,
    )
    _rotate_heads(
        k_ptr + token * stride_k_token,
        k_out_ptr + token * stride_k_out_token,
        stride_k_head,
        stride_k_dim,
        stride_k_out_head,
        num_kv_heads,
        half_dim,
        cos1[None, :],
        cos2[None, :],
        sin1[None, :],
        sin2[None, :],
        offs_d,
        mask_d,
        BLOCK_KVH,
    )


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (q, k) as new contiguous tensors; q and k are left unchanged.

    Raises ValueError for mismatched shapes, dtypes or devices, or an odd head_dim.
    """
    _check(positions, q, k, cos, sin)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    block_half = triton.next_power_of_2(head_dim // 2)
    max_heads = max(1, _MAX_TILE // block_half)
    launch(
        _rotary_embedding_kernel,
        (num_tokens,),
        positions,
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        *q.stride(),
        *k.stride(),
        *cos.stride(),
        *sin.stride(),
        *q_out.stride()[:2],
        *k_out.stride()[:2],
        num_heads,
        num_kv_heads,
        head_dim // 2,
        BLOCK_H=min(triton.next_power_of_2(num_heads), max_heads),
        BLOCK_KVH=min(triton.next_power_of_2(num_kv_heads), max_heads),
        BLOCK_HALF=block_half,
        num_warps=4,
        enable_fp_fusion=False,  # an fma would round x1 * c - x2 * s once, torch rounds twice
    )
    return q_out, k_out


def ref_rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (and the CPU path): the neox rotation on the looked-up rows."""
    cos_t, sin_t = cos[positions], sin[positions]  # [T, D]
    return _rotate(q, cos_t, sin_t), _rotate(k, cos_t, sin_t)


def _check(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            "q and k must be [num_tokens, heads, head_dim]; "
            f"got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    num_tokens, _, head_dim = q.shape
    if (k.shape[0], k.shape[2]) != (num_tokens, head_dim):
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in tokens and head_dim")
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for the neox rotation; got {head_dim}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim:
        raise ValueError(
            f"cos and sin must both be [max_positions, {head_dim}]; "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be int64 (or int32) [{num_tokens}]; "
            f"got {positions.dtype} {tuple(positions.shape)}"
        )
    floats = (q, k, cos, sin)
    if any(t.dtype != q.dtype for t in floats) or not q.dtype.is_floating_point:
        raise ValueError(
            "q, k, cos and sin must share one floating-point dtype; got "
            + ", ".join(str(t.dtype) for t in floats)
        )
    check_device(_rotary_embedding_kernel, "ref_rotary_embedding", positions, *floats)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by per-token cos/sin [T, D] (neox: halves, not pairs).

    The same arithmetic as the engine's `apply_rotary` (kernels are a leaf package and do
    not import the engine; tests/kernels compares the two).
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
