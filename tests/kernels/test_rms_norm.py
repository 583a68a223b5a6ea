"""rms_norm (Triton) against its torch reference, the engine's rms_norm and transformers.

On CPU the kernel runs in Triton's interpreter (see conftest.py), which is slow: shapes stay
tiny. bf16 runs only on a GPU: the interpreter computes bf16 wrongly (Triton 3.9's rounds
float32 -> bf16 toward zero, not to nearest), and the fp32/fp16 cases are its CPU twins.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.modeling.llama import rms_norm as engine_rms_norm
from pdserve.kernels.rms_norm import ref_rms_norm, rms_norm

EPS = 1e-5
EXACT = {"atol": 0.0, "rtol": 0.0}
# Kernel vs reference. fp32: the float32 sum of squares runs in another order (a few ulp).
# 16-bit: that ulp-sized difference can flip the rounding of `normed` to the dtype, one ulp
# (2**-10 relative for fp16, 2**-7 for bf16) before the weight multiplies it.
TOLERANCES = {
    torch.float32: {"atol": 1e-6, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 8e-3, "rtol": 8e-3},
}
# Compiled Triton only: under TRITON_INTERPRET=1 even a GPU's tensors go through the interpreter.
NEEDS_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a GPU (compiled Triton)",
)
SHAPES = [(1, 8), (3, 40), (4, 100)]  # (num_tokens, hidden_size); 40 and 100 need masking


def inputs(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(num_tokens, hidden_size, generator=gen)).to(device, dtype)
    weight = (1 + 0.5 * torch.randn(hidden_size, generator=gen)).to(device, dtype)
    residual = torch.randn(num_tokens, hidden_size, generator=gen).to(device, dtype)
    return x, weight, residual


def run_case(num_tokens: int, hidden_size: int, dtype: torch.dtype, device: str) -> None:
    x, weight, residual = inputs(num_tokens, hidden_size, dtype, device)
    x0, residual0 = x.clone(), residual.clone()

    out = rms_norm(x, weight, EPS)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, ref_rms_norm(x, weight, EPS), **TOLERANCES[dtype])

    fused = rms_norm(x, weight, EPS, residual=residual)
    expected = ref_rms_norm(x, weight, EPS, residual=residual)
    assert isinstance(fused, tuple) and isinstance(expected, tuple)
    torch.testing.assert_close(fused[0], expected[0], **TOLERANCES[dtype])
    # x + residual is one correctly rounded add on both sides: exact.
    torch.testing.assert_close(fused[1], expected[1], **EXACT)
    # New tensors: the inputs are left alone.
    torch.testing.assert_close(x, x0, **EXACT)
    torch.testing.assert_close(residual, residual0, **EXACT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_tokens", "hidden_size"), SHAPES)
def test_matches_reference(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: str
) -> None:
    run_case(num_tokens, hidden_size, dtype, device)


@NEEDS_GPU
@pytest.mark.parametrize(("num_tokens", "hidden_size"), SHAPES)
def test_matches_reference_bf16_gpu(num_tokens: int, hidden_size: int) -> None:
    run_case(num_tokens, hidden_size, torch.bfloat16, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_is_the_engines_and_transformers_rms_norm(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, weight, _ = inputs(3, 40, dtype, "cpu")
    hf_norm = LlamaRMSNorm(40, eps=EPS).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(weight)
        expected = hf_norm(x)
    torch.testing.assert_close(ref_rms_norm(x, weight, EPS), expected, **EXACT)
    torch.testing.assert_close(engine_rms_norm(x, weight, EPS), expected, **EXACT)


def test_matches_transformers_fp32(device: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, weight, _ = inputs(4, 100, torch.float32, device)
    hf_norm = LlamaRMSNorm(100, eps=EPS).to(device)
    with torch.no_grad():
        hf_norm.weight.copy_(weight)
        expected = hf_norm(x)
    torch.testing.assert_close(rms_norm(x, weight, EPS), expected, **TOLERANCES[torch.float32])


def test_strided_input(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, generator=gen).to(device).t()  # [3, 40], column stride 3
    weight = torch.randn(40, generator=gen).to(device)
    residual = torch.randn(3, 80, generator=gen).to(device)[:, ::2]  # column stride 2
    out, s = rms_norm(x, weight, EPS, residual=residual)
    expected_out, expected_s = ref_rms_norm(x, weight, EPS, residual=residual)
    torch.testing.assert_close(out, expected_out, **TOLERANCES[torch.float32])
    torch.testing.assert_close(s, expected_s, **EXACT)


def test_rejects_bad_arguments(device: str) -> None:
    x, weight, residual = inputs(3, 40, torch.float32, device)
    with pytest.raises(ValueError, match="num_tokens, hidden_size"):
        rms_norm(x[None], weight, EPS)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, weight[:-1], EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, weight, EPS, residual=residual[:, :-1])
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x.half(), weight, EPS)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x, weight, EPS, residual=residual.half())
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, weight, -1.0)
    too_wide = torch.zeros(1, 16385, device=device)  # > 65536 bytes of fp32 in one tile
    with pytest.raises(ValueError, match="single-tile limit"):
        rms_norm(too_wide, torch.ones(16385, device=device), EPS)
