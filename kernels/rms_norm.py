"""RMSNorm over the last dimension, with an optional fused residual add.

What it computes, row by row (as transformers' LlamaRMSNorm does):

    s      = x + residual            (only with a residual; rounded to x's dtype)
    normed = s * rsqrt(mean(s ** 2) + eps)      statistics in float32
    out    = weight * normed.to(dtype)          product rounded to x's dtype

Returns out, or (out, s) with a residual: s is the new residual stream. Both are NEW tensors;
nothing is written in place (vLLM's `fused_add_rms_norm` overwrites x and residual instead).

Memory layout:

    x, residual   [num_tokens, hidden_size]   any strides
    weight        [hidden_size]
    out, s        [num_tokens, hidden_size]   contiguous, x's dtype

Limits: x, residual and weight share one dtype; one program normalises one row held whole in
registers, so hidden_size <= 65536 / itemsize (the tutorial's 64 KB bound; Llama's largest
hidden size, 16384, fits in every 16- and 32-bit dtype). Results match the torch reference up
to the float32 summation order of the statistics (see the tests for tolerances).

Provenance: the Triton layer-norm tutorial (python/tutorials/05-layer-norm.py: one program per
row, the 64 KB fused-size bound and its warp heuristic), vLLM's `rms_norm` /
`fused_add_rms_norm` (the fused residual add), transformers' LlamaRMSNorm (the rounding points).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import check_device
from pdserve.kernels._variants import launch


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]  # Triton args stay unannotated
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x_row,
    stride_x_col,
    stride_residual_row,
    stride_residual_col,
    stride_weight,
    stride_out_row,
    stride_residual_out_row,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    mask = offs_h < hidden_size
    x = tl.load(x_ptr + row * stride_x_row + offs_h * stride_x_col, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr + row * stride_residual_row + offs_h * stride_residual_col,
            mask=mask,
            other=0.0,
        )
        # Rounded to x's dtype before the statistics, as the model's `residual + out` is.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out_row + offs_h, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden_size
    # Correctly rounded sqrt and division (not the approximate rsqrt), like torch.rsqrt.
    normed = x32 * tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
    weight = tl.load(weight_ptr + offs_h * stride_weight, mask=mask, other=0.0)
    # transformers rounds `normed` to the dtype, then multiplies in the dtype; the float32
    # product of two 16-bit floats is exact, so rounding it once gives that same result.
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    out = weight.to(tl.float32) * normed
    tl.store(out_ptr + row * stride_out_row + offs_h, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * normalize(x), or (weight * normalize(x + residual), x + residual).

    Returns new tensors (x and residual are not modified). Raises ValueError for mismatched
    shapes, dtypes or devices, or a hidden size over the single-tile limit.
    """
    block_h = _check(x, weight, eps, residual)
    num_tokens, hidden_size = x.shape
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else out
    if num_tokens > 0:
        residual_in = residual if residual is not None else x  # unused without HAS_RESIDUAL
        launch(
            _rms_norm_kernel,
            (num_tokens,),
            x,
            residual_in,
            weight,
            out,
            residual_out,
            *x.stride(),
            *residual_in.stride(),
            weight.stride(0),
            out.stride(0),
            residual_out.stride(0),
            hidden_size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_H=block_h,
            num_warps=min(max(block_h // 256, 1), 8),  # the layer-norm tutorial's heuristic
            enable_fp_fusion=False,  # no fma contraction: stay close to torch's separate ops
        )
    return out if residual is None else (out, residual_out)


def ref_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: engine.model.rms_norm's arithmetic (a test pins the two equal).

    Not imported from the engine: the model will import this module, and the reverse import
    would be a cycle.
    """
    s = x if residual is None else x + residual
    s32 = s.float()
    normed = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(s.dtype)
    return out if residual is None else (out, s)


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> int:
    """Validate the arguments; return the tile width BLOCK_H."""
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden_size]; got {tuple(x.shape)}")
    hidden_size = x.shape[1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight must be [{hidden_size}]; got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    tensors = [x, weight] if residual is None else [x, weight, residual]
    if any(t.dtype != x.dtype for t in tensors) or not x.dtype.is_floating_point:
        raise ValueError(
            "x, weight and residual must share one floating-point dtype; got "
            + ", ".join(str(t.dtype) for t in tensors)
        )
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0; got {eps}")
    check_device(_rms_norm_kernel, "ref_rms_norm", *tensors)
    max_fused_size = 65536 // x.element_size()
    block_h = triton.next_power_of_2(hidden_size)
    if block_h > max_fused_size:
        raise ValueError(
            f"hidden_size {hidden_size} exceeds the single-tile limit {max_fused_size} "
            f"for {x.dtype}"
        )
    return block_h
