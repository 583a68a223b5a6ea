"""int8_linear (Triton) against its torch reference, and the engine's Int8Linear on CUDA.

On CPU the kernel runs in Triton's interpreter (see conftest.py), which is slow: shapes
stay tiny, but cross every tile boundary the launcher picks (M 16/17 and 64/65 rows; N and
K one past a tile) and include odd sizes. bf16 runs only on a GPU: the interpreter
computes bf16 wrongly; the fp32/fp16 cases are its CPU twins, and the engine's CPU path
(`Int8Linear` through torch's op) is tested in tests/engine/test_quantization.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.modeling.linear import Int8Linear
from pdserve.kernels.int8_linear import int8_linear, ref_int8_linear

# Kernel vs the float64 reference, both rounded to the dtype once: fp32 accumulates over
# K in another order (a few ulp of the sum of |x * w|); 16-bit: one ulp of the output.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3},
}
# Compiled Triton only: under TRITON_INTERPRET=1 even a GPU's tensors go through the interpreter.
NEEDS_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a GPU (compiled Triton)",
)
# (rows, in_features, out_features)
SHAPES = [(1, 40, 17), (16, 64, 32), (17, 257, 33), (65, 33, 129), (3, 1, 5)]


def inputs(
    rows: int, in_features: int, out_features: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(device, dtype)
    weight = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = (torch.rand(out_features, generator=gen) + 0.5) / 127
    bias = torch.randn(out_features, generator=gen)
    return x, weight.to(device), scales.to(device, dtype), bias.to(device, dtype)


def run_case(shape: tuple[int, int, int], dtype: torch.dtype, device: str) -> None:
    x, weight, scales, bias = inputs(*shape, dtype, device)
    for b in (None, bias):
        out = int8_linear(x, weight, scales, b)
        assert out.dtype == dtype and out.shape == (shape[0], shape[2])
        torch.testing.assert_close(out, ref_int8_linear(x, weight, scales, b), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape: tuple[int, int, int], dtype: torch.dtype, device: str) -> None:
    run_case(shape, dtype, device)


def test_strided_inputs_and_no_rows(device: str) -> None:
    x, weight, scales, bias = inputs(5, 48, 20, torch.float32, device)
    wide = torch.zeros(5, 96, device=device)
    wide[:, ::2] = x
    torch.testing.assert_close(
        int8_linear(wide[:, ::2], weight, scales, bias), ref_int8_linear(x, weight, scales, bias)
    )
    transposed = weight.T.contiguous().T  # column-major rows
    torch.testing.assert_close(
        int8_linear(x, transposed, scales), ref_int8_linear(x, weight, scales), atol=1e-5, rtol=1e-5
    )
    assert int8_linear(x[:0], weight, scales).shape == (0, 20)


def test_rejects_bad_inputs(device: str) -> None:
    x, weight, scales, _ = inputs(2, 16, 8, torch.float32, device)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        int8_linear(x[:, :8], weight, scales)
    with pytest.raises(ValueError, match="int8"):
        int8_linear(x, weight.float(), scales)
    with pytest.raises(ValueError, match=r"\[8\]"):
        int8_linear(x, weight, scales[:4])


@NEEDS_GPU
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference_bf16_gpu(shape: tuple[int, int, int]) -> None:
    run_case(shape, torch.bfloat16, "cuda")


@NEEDS_GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_engine_int8_linear_on_cuda_runs_the_kernel(dtype: torch.dtype) -> None:
    """Int8Linear on CUDA (the Triton kernel) against the same layer on CPU (torch's op)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 200, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(9, 200, generator=gen).to(dtype)
    on_cpu, on_gpu = (
        Int8Linear.quantize(weight, bias),
        Int8Linear.quantize(weight.cuda(), bias.cuda()),
    )
    assert on_gpu._kernel is int8_linear
    assert torch.equal(on_gpu.weight.cpu(), on_cpu.weight[:, :200])
    torch.testing.assert_close(on_gpu(x.cuda()).cpu(), on_cpu(x), **TOLERANCES[dtype])
