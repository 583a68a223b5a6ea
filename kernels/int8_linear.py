"""Weight-only int8 linear: y = x @ (w * scales[:, None]).T + bias, the weight read as int8.

What it computes, for x [M, K] in a float dtype, w [N, K] int8 and scales [N]:

    y[m, n] = scales[n] * sum_k x[m, k] * w[n, k]  (+ bias[n])

The int8 tile is widened to x's dtype in registers (exact: |w| <= 127 fits every float
format) and multiplied on the tensor cores with float32 accumulation; the per-row scale
and the bias apply once, to the accumulator. The weight crosses memory as one byte per
element and is never dequantized in memory: a decode step, which reads every weight once
and is bound by memory bandwidth, reads half the bytes of bf16 weights.

Memory layout:

    x        [M, K]   fp16 / bf16 / fp32, any strides
    w        [N, K]   int8, any strides (the engine's: contiguous rows)
    scales   [N]      any float dtype (read as float32)
    bias     [N]      optional, any float dtype
    out      [M, N]   x's dtype, contiguous

Algorithm: one program per (BLOCK_M rows, BLOCK_N output features) tile, walking K in
BLOCK_K steps (the Triton matmul tutorial's loop, without its grouped ordering: at decode
sizes M fits one tile). Small M (decode) takes narrow, deep tiles so that many programs
stream the weight; large M (prefill) square ones that reuse each weight tile across rows.

Limits: K and N any size (masked); fp32 inputs use IEEE fp32 dots (no TF32), so an fp32
model matches the torch reference to float rounding; the result rounds to x's dtype once.
The tile sizes are not yet tuned by timing on a GPU.

Provenance: the Triton tutorial 03-matrix-multiplication (tiling, masking), with the int8
operand widened in registers as gpt-fast's and torchao's int8 weight-only matmuls (which
leave that fusion to torch.compile) do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import check_device
from pdserve.kernels._variants import launch

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (largest M, (BLOCK_M, BLOCK_N, BLOCK_K, warps)) by rows, ascending; the last takes any M.
# Small M (decode): narrow and deep, many programs streaming the weight. fp32's IEEE dots
# are FMA loops: small tiles, as the attention's.
_TILES_16BIT = ((16, (16, 32, 256, 4)), (64, (64, 64, 64, 4)), (None, (128, 128, 64, 8)))
_TILES_FP32 = ((None, (32, 32, 32, 4)),)


# The row count follows the step's tokens: Triton's own specialisation of it (== 1,
# divisible by 16) would make a variant per kind of step (kernels/_variants.py); the tiles
# are already one of a few. The features and strides are fixed per layer.
@triton.jit(do_not_specialize=["num_rows"])
def _int8_linear_kernel(  # type: ignore[no-untyped-def]  # Triton args stay unannotated
    x_ptr,
    w_ptr,
    scales_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    out_features,
    in_features,
    stride_x_m,
    stride_x_k,
    stride_w_n,
    stride_w_k,
    stride_out_m,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # int64 offsets: N * K of a large projection passes 2**31 elements.
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < num_rows
    mask_n = offs_n < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        k = k_start + offs_k
        mask_k = k < in_features
        x_ptrs = x_ptr + offs_m[:, None] * stride_x_m + k[None, :] * stride_x_k
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        w_ptrs = w_ptr + offs_n[None, :] * stride_w_n + k[:, None] * stride_w_k
        w = tl.load(w_ptrs, mask=mask_n[None, :] & mask_k[:, None], other=0)  # [BK, BN] int8
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    acc = acc * tl.load(scales_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_out_m + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def int8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """x @ (weight * scales[:, None]).T + bias, in x's dtype, [M, N].

    Raises:
        ValueError: on mismatched shapes, dtypes or devices.
    """
    _check(x, weight, scales, bias)
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows == 0 or out_features == 0:
        return out
    block_m, block_n, block_k, num_warps = _tile(num_rows, x.dtype)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))
    launch(
        _int8_linear_kernel,
        grid,
        x,
        weight,
        scales,
        bias if bias is not None else scales,  # unused without HAS_BIAS
        out,
        num_rows,
        out_features,
        in_features,
        *x.stride(),
        *weight.stride(),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=num_warps,
    )
    return out


def ref_int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference: the dequantized weight in float64, one rounding to x's dtype."""
    w = weight.double() * scales.double()[:, None]
    y = x.double() @ w.T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def _tile(num_rows: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) for `num_rows` rows of `dtype`; tl.dot needs
    every block dimension >= 16."""
    for max_rows, tile in _tiles(dtype):
        if max_rows is None or num_rows <= max_rows:
            return tile
    raise AssertionError("the last tile takes any row count")


def row_buckets(dtype: torch.dtype) -> tuple[int, ...]:
    """The smallest row count of each tile `_tile` picks for `dtype`: 1, then one past
    each tile's largest."""
    return (1, *(max_rows + 1 for max_rows, _ in _tiles(dtype) if max_rows is not None))


def _tiles(dtype: torch.dtype) -> tuple[tuple[int | None, tuple[int, int, int, int]], ...]:
    return _TILES_FP32 if dtype == torch.float32 else _TILES_16BIT


def _check(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x must be [M, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    out_features = weight.shape[0]
    if scales.shape != (out_features,) or (bias is not None and bias.shape != (out_features,)):
        raise ValueError(f"scales and bias must be [{out_features}]")
    if x.dtype not in _SUPPORTED_DTYPES or weight.dtype != torch.int8:
        raise ValueError(
            f"x must be one of {_SUPPORTED_DTYPES} and weight int8; got {x.dtype}, {weight.dtype}"
        )
    tensors = [x, weight, scales] if bias is None else [x, weight, scales, bias]
    check_device(_int8_linear_kernel, "ref_int8_linear", *tensors)
