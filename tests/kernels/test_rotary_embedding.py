"""rotary_embedding (Triton) against engine.rotary.apply_rotary, over default/linear/llama3 tables.

On CPU the kernel runs in Triton's interpreter (see conftest.py), which is slow: shapes stay
tiny. The kernel rounds each product and the sum to the dtype where torch does (and fma
contraction is off), so it is compared bitwise: atol=0, rtol=0. bf16 runs only on a GPU: the
interpreter computes bf16 wrongly (Triton 3.9's rounds float32 -> bf16 toward zero, not to
nearest), and the fp32/fp16 cases are its CPU twins.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.common.model_config import RopeConfig
from pdserve.engine.modeling.rotary import cos_sin_cache, inverse_frequencies
from pdserve.kernels.rotary_embedding import ref_rotary_embedding, rotary_embedding

EXACT = {"atol": 0.0, "rtol": 0.0}
# Compiled Triton only: under TRITON_INTERPRET=1 even a GPU's tensors go through the interpreter.
NEEDS_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a GPU (compiled Triton)",
)
MAX_POSITIONS = 64
# Positions include the table's first and last rows.
POSITIONS = [0, MAX_POSITIONS - 1, 17, 5, MAX_POSITIONS - 1]
ROPES = {
    "default": RopeConfig(theta=10000.0),
    "linear": RopeConfig(theta=10000.0, rope_type="linear", factor=4.0),
    # With head_dim 12 the wavelengths (6, 29, 135, 628, ...) fall in all three llama3 bands
    # of original_max_position_embeddings=256: kept, smoothed, and divided by `factor`.
    "llama3": RopeConfig(
        theta=10000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=256,
    ),
}
# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 4 and 8; half head_dims 6 and 10 need masking.
HEADS = [(2, 2, 12), (8, 2, 20), (8, 1, 12)]


def run_case(
    rope: RopeConfig,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens = len(POSITIONS)
    cos, sin = cos_sin_cache(rope, head_dim, MAX_POSITIONS, dtype)
    cos, sin = cos.to(device), sin.to(device)
    # q and k are strided views of one fused qkv row, as the model's split hands them over.
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (4 * torch.randn(num_tokens, width, generator=gen)).to(device, dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k_end = (num_heads + num_kv_heads) * head_dim
    k = qkv[:, num_heads * head_dim : k_end].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor(POSITIONS, dtype=torch.int64, device=device)
    qkv0 = qkv.clone()

    q_rot, k_rot = rotary_embedding(positions, q, k, cos, sin)
    q_ref, k_ref = ref_rotary_embedding(positions, q, k, cos, sin)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape and q_rot.dtype == dtype
    torch.testing.assert_close(q_rot, q_ref, **EXACT)
    torch.testing.assert_close(k_rot, k_ref, **EXACT)
    torch.testing.assert_close(qkv, qkv0, **EXACT)  # out of place: q and k untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("rope_type", list(ROPES))
def test_matches_apply_rotary(
    rope_type: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
) -> None:
    run_case(ROPES[rope_type], num_heads, num_kv_heads, head_dim, dtype, device)


@NEEDS_GPU
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("rope_type", list(ROPES))
def test_matches_apply_rotary_bf16_gpu(
    rope_type: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    run_case(ROPES[rope_type], num_heads, num_kv_heads, head_dim, torch.bfloat16, "cuda")


def test_scaled_tables_really_differ() -> None:
    # Guards the parametrisation above: three rope types, three different tables.
    default, linear, llama3 = (inverse_frequencies(ROPES[name], 12) for name in ROPES)
    assert torch.equal(linear, default / 4.0)
    assert not torch.equal(llama3, default) and not torch.equal(llama3, default / 8.0)
    assert llama3[0] == default[0] and llama3[-1] == default[-1] / 8.0  # kept; divided
    assert default[2] / 8.0 < llama3[2] < default[2]  # smoothed


def test_rejects_bad_arguments(device: str) -> None:
    cos, sin = cos_sin_cache(ROPES["default"], 12, MAX_POSITIONS, torch.float32)
    cos, sin = cos.to(device), sin.to(device)
    q = torch.randn(3, 4, 12, device=device)
    k = torch.randn(3, 2, 12, device=device)
    positions = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match="even"):
        rotary_embedding(positions, q[..., :11], k[..., :11], cos[:, :11], sin[:, :11])
    with pytest.raises(ValueError, match="dtype"):
        rotary_embedding(positions, q.half(), k.half(), cos, sin)
    with pytest.raises(ValueError, match="must match q"):
        rotary_embedding(positions, q, k[..., :10], cos, sin)
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(positions.float(), q, k, cos, sin)
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(positions[:2], q, k, cos, sin)
    with pytest.raises(ValueError, match="cos and sin"):
        rotary_embedding(positions, q, k, cos[:, :10], sin[:, :10])
    with pytest.raises(ValueError, match="num_tokens, heads, head_dim"):
        rotary_embedding(positions, q[0], k, cos, sin)
