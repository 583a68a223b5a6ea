"""paged_decode_attention (Triton) against its torch reference, and the reference against SDPA.

On CPU the kernel runs in Triton's interpreter (see conftest.py), which is slow: shapes
stay tiny. Caches come from conftest's `make_paged_kv`: unowned slots are NaN, so reading
past a sequence's end or through a block table's padding fails the comparison.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import _kv8
from pdserve.kernels.paged_decode_attention import (
    _auto_num_splits,
    paged_decode_attention,
    ref_paged_decode_attention,
)

# Tolerances of kernel vs reference. fp32: online softmax and exp2 reorder the sums.
# fp16: the kernel rounds probabilities to fp16 before P @ V (as FlashAttention does),
# and the output itself is fp16 (ulp 1e-3 near 1).
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
NEEDS_COMPILED_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a GPU (compiled Triton)",
)

MakePagedKV = Callable[..., tuple]  # conftest's factory


def run_case(
    make_paged_kv: MakePagedKV,
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    num_splits: int | None,
    dtype: torch.dtype,
    device: str,
) -> None:
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, dtype, device
    )
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale, num_splits)
    expected = ref_paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


# (context_lens, num_heads, num_kv_heads, block_size, head_dim, num_splits). Lengths mix
# 1-token and long sequences, end exactly on a block (16, 64) and one past it (17, 65).
CASES = {
    "gqa1-bs16": ([1, 70, 16, 17, 33], 4, 4, 16, 64, 1),
    "gqa1-bs16-split3": ([1, 70, 16, 17, 33], 4, 4, 16, 64, 3),
    "gqa4-bs8": ([8, 9, 64, 65], 8, 2, 8, 64, 1),
    "gqa4-bs8-split4": ([8, 9, 64, 65], 8, 2, 8, 64, 4),
    "gqa8-d40-split2": ([1, 41, 64], 8, 1, 16, 40, 2),
    "gqa8-d80-bs8": ([1, 41, 64], 8, 1, 8, 80, 1),
    # More splits than pages: most splits are empty; an empty context gives a zero row.
    "empty-splits": ([0, 1, 5, 24], 4, 2, 8, 64, 8),
}


# bf16 is not among them: the interpreter computes bf16 arithmetic wrongly (docs/architecture.md,
# "Kernels"); the GPU-only test below covers it.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(
    case: tuple, dtype: torch.dtype, device: str, make_paged_kv: MakePagedKV
) -> None:
    run_case(make_paged_kv, *case, dtype=dtype, device=device)


@NEEDS_COMPILED_GPU
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference_bf16(case: tuple, device: str, make_paged_kv: MakePagedKV) -> None:
    """The GPU twin of test_matches_reference, in bf16."""
    run_case(make_paged_kv, *case, dtype=torch.bfloat16, device=device)


def run_8bit_case(
    make_paged_kv: MakePagedKV,
    quantize_kv: Callable[..., tuple],
    dequantize_kv: Callable[..., torch.Tensor],
    case: tuple,
    kv_dtype: str,
    dtype: torch.dtype,
    device: str,
) -> None:
    """A case of CASES over an 8-bit cache (engine/modeling/kv_quant.py) against the reference over
    its dequantized values; unowned slots have NaN scales."""
    context_lens, num_heads, num_kv_heads, block_size, head_dim, num_splits = case
    paged = make_paged_kv(context_lens, num_kv_heads, head_dim, block_size, torch.float32, device)
    k8, v8, block_tables, _, _ = quantize_kv(paged, kv_dtype)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        q, k8, v8, block_tables, lens, scale, num_splits, kv_cache_dtype=kv_dtype
    )
    k, v = dequantize_kv(k8, kv_dtype), dequantize_kv(v8, kv_dtype)
    expected = ref_paged_decode_attention(q, k, v, block_tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


# (case, kv dtype, q dtype): GQA with split-K, an odd head_dim (rows of 42 bytes), fp16
KV8_CASES = {
    "int8-gqa4-split4-fp32": ("gqa4-bs8-split4", "int8", torch.float32),
    "fp8-gqa8-d40-split2-fp32": ("gqa8-d40-split2", "fp8", torch.float32),
    "fp8-gqa4-bs8-fp16": ("gqa4-bs8", "fp8", torch.float16),
    "int8-empty-splits-fp16": ("empty-splits", "int8", torch.float16),
}


@pytest.mark.parametrize(("case", "kv_dtype", "dtype"), KV8_CASES.values(), ids=KV8_CASES.keys())
def test_8bit_cache_matches_reference(
    case: str,
    kv_dtype: str,
    dtype: torch.dtype,
    device: str,
    make_paged_kv: MakePagedKV,
    quantize_kv: Callable[..., tuple],
    dequantize_kv: Callable[..., torch.Tensor],
) -> None:
    run_8bit_case(make_paged_kv, quantize_kv, dequantize_kv, CASES[case], kv_dtype, dtype, device)


def test_8bit_cache_e4m3_decoded_arithmetically(
    device: str,
    make_paged_kv: MakePagedKV,
    quantize_kv: Callable[..., tuple],
    dequantize_kv: Callable[..., torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The e4m3 decoding of GPUs without float8 conversions (before sm_89), in bits."""
    monkeypatch.setattr(_kv8, "fp8_native", lambda device: False)
    case = CASES["gqa8-d80-bs8"]
    run_8bit_case(make_paged_kv, quantize_kv, dequantize_kv, case, "fp8", torch.float32, device)


@NEEDS_COMPILED_GPU
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_8bit_cache_matches_reference_bf16(
    case: tuple,
    kv_dtype: str,
    device: str,
    make_paged_kv: MakePagedKV,
    quantize_kv: Callable[..., tuple],
    dequantize_kv: Callable[..., torch.Tensor],
) -> None:
    """The GPU twin of test_8bit_cache_matches_reference: every case, bf16 queries."""
    run_8bit_case(make_paged_kv, quantize_kv, dequantize_kv, case, kv_dtype, torch.bfloat16, device)


def test_auto_split_long_context(device: str, make_paged_kv: MakePagedKV) -> None:
    """One long sequence and one kv head: the heuristic splits it, and the result holds."""
    context_len, block_size = 600, 16
    max_context = (-(-context_len // block_size) + 1) * block_size  # make_paged_kv's spare
    assert _auto_num_splits(1, max_context, torch.device("cpu")) == 2
    run_case(make_paged_kv, [context_len], 4, 1, block_size, 64, None, torch.float32, device)


def test_auto_num_splits_heuristic() -> None:
    cpu = torch.device("cpu")
    assert _auto_num_splits(2, 4096, cpu) == 8  # few programs, long context: split
    assert _auto_num_splits(256, 4096, cpu) == 1  # the batch already fills the device
    assert _auto_num_splits(2, 200, cpu) == 1  # too short to be worth a split
    assert _auto_num_splits(1, 1 << 20, cpu) == 16  # capped by programs wanted


def test_strided_q(device: str, make_paged_kv: MakePagedKV) -> None:
    """q as a slice of a fused qkv tensor (non-contiguous) gives the same result."""
    context_lens, num_heads, num_kv_heads, head_dim = [3, 20], 4, 2, 64
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        context_lens, num_kv_heads, head_dim, 8, torch.float32, device
    )
    qkv = torch.randn(2, num_heads + 2 * num_kv_heads, head_dim, device=device)
    q = qkv[:, :num_heads]
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125)
    expected = ref_paged_decode_attention(
        q.contiguous(), k_cache, v_cache, block_tables, lens, 0.125
    )
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_reference_matches_sdpa(make_paged_kv: MakePagedKV) -> None:
    """The reference itself, against SDPA on the dense (unpaged) K/V with torch's own GQA."""
    context_lens, num_heads, num_kv_heads, head_dim = [1, 17, 40], 8, 2, 64
    k_cache, v_cache, block_tables, dense_k, dense_v = make_paged_kv(
        context_lens, num_kv_heads, head_dim, 8, torch.float32, "cpu"
    )
    q = torch.randn(len(context_lens), num_heads, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = ref_paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.3)
    for b in range(len(context_lens)):
        expected = F.scaled_dot_product_attention(
            q[b][None, :, None],  # [1, H, 1, D]
            dense_k[b].transpose(0, 1)[None],  # [1, KVH, n, D]
            dense_v[b].transpose(0, 1)[None],
            scale=0.3,
            enable_gqa=True,
        )
        torch.testing.assert_close(out[b], expected[0, :, 0], atol=1e-5, rtol=1e-5)


def test_rejects_bad_input(device: str, make_paged_kv: MakePagedKV) -> None:
    k_cache, v_cache, block_tables, _, _ = make_paged_kv([5], 2, 64, 8, torch.float32, device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    q = torch.randn(1, 4, 64, device=device)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_decode_attention(q, k_cache, v_cache, block_tables.long(), lens, 0.1)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, lens.long(), 0.1)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="must share one of"):
        paged_decode_attention(q.half(), k_cache, v_cache, block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="head_dim of q"):
        paged_decode_attention(q[..., :32], k_cache, v_cache, block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1, num_splits=0)
    rows = torch.zeros(*k_cache.shape[:3], 66, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="must share one of"):  # 8-bit rows read as fp32
        paged_decode_attention(q, rows, rows, block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="rows of 66"):  # fp32 rows read as 8-bit
        paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="rows of 66"):  # rows without their scale
        cut = rows[..., :64]
        paged_decode_attention(q, cut, cut, block_tables, lens, 0.1, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        paged_decode_attention(q, rows, rows, block_tables, lens, 0.1, kv_cache_dtype="fp4")
