"""The model's small ops in C (`engine/cpu/csrc/model_ops.c`, `CpuOps`) against the torch
ops they replace (`rms_norm`, `apply_rotary`, `F.silu(gate) * up`).

bfloat16 results must be equal, element for element: the C loops round every product and
sum as torch does, and the two differences (the norm's mean of squares summed in double,
the SiLU's polynomial exp) sit below what a bfloat16 rounding can see. float32 results
agree to a few ulp. Shapes cover decode and prefill row counts (one thread and the pool),
strided inputs (q and k are column slices of the fused qkv output), and the fallbacks:
float16, and a norm wider than the kernel's row buffer, run the torch ops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import LLM
from pdserve.engine.cpu import kernels as cpu_kernels
from pdserve.engine.modeling.attention import CpuAttentionBackend, TorchAttentionBackend
from pdserve.engine.modeling.llama import rms_norm
from pdserve.engine.modeling.ops import CpuOps, TorchOps, ops_for
from pdserve.engine.modeling.rotary import apply_rotary

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler: kernels not built")
DTYPES = [torch.bfloat16, torch.float32]


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal for bfloat16; within a few float32 ulp (relative) for float32."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ"
    else:
        torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,threads", [(1, 1), (7, 2), (96, 2), (96, 1)])
def test_the_norm_with_and_without_the_residual_add(
    dtype: torch.dtype, rows: int, threads: int
) -> None:
    assert KERNELS is not None
    g = torch.Generator().manual_seed(rows)
    hidden = 1024
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    out, summed = KERNELS.add_rms_norm(x, weight, 1e-5, residual, num_threads=threads)
    want_sum = x + residual
    same(summed, want_sum)
    same(out, rms_norm(want_sum, weight, 1e-5))
    plain, kept = KERNELS.add_rms_norm(x, weight, 1e-6, None, num_threads=threads)
    assert kept is x  # no residual: the sum is x itself, as TorchOps returns it
    same(plain, rms_norm(x, weight, 1e-6))
    # x's rows may be strided (a slice of a wider tensor); the residual is untouched
    wide = torch.randn(rows, hidden + 64, generator=g).to(dtype)
    before = residual.clone()
    out, _ = KERNELS.add_rms_norm(wide[:, 32 : 32 + hidden], weight, 1e-5, residual, threads)
    same(out, rms_norm(wide[:, 32 : 32 + hidden] + residual, weight, 1e-5))
    assert torch.equal(residual, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,threads", [(1, 1), (5, 2), (300, 2)])
def test_rotary_of_q_and_k_sliced_from_qkv(dtype: torch.dtype, tokens: int, threads: int) -> None:
    assert KERNELS is not None
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, head_dim, max_pos = 8, 2, 64, 512
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.rand(max_pos, head_dim // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    q_out, k_out = KERNELS.rotary_neox(positions, q, k, cos, sin, num_threads=threads)
    same(q_out, apply_rotary(q, cos[positions], sin[positions]))
    same(k_out, apply_rotary(k, cos[positions], sin[positions]))
    with pytest.raises(IndexError, match="outside the rotary tables"):
        KERNELS.rotary_neox(positions + max_pos, q, k, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,threads", [(1, 1), (33, 2), (64, 2)])
def test_silu_and_multiply(dtype: torch.dtype, rows: int, threads: int) -> None:
    assert KERNELS is not None
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1408, generator=g) * 5).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # both tails and zeros
    gate, up = gate_up.chunk(2, dim=-1)
    same(KERNELS.silu_mul(gate_up, num_threads=threads), F.silu(gate) * up)


@pytest.mark.parametrize("rows,vocab,threads", [(1, 1, 1), (3, 65, 1), (32, 4000, 2), (5, 200, 2)])
def test_argmax_picks_what_torch_picks(rows: int, vocab: int, threads: int) -> None:
    """The greedy sampler's argmax: torch's indices exactly, the first of tied maxima (a
    block boundary included), the first NaN, a row of -inf, signed zeros, strided rows."""
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=gen)
    tied = x.round()  # many equal maxima
    tied[:, -1] = tied.max() + 1 if vocab > 64 else tied[:, -1]
    tied[:, min(64, vocab - 1)] = tied[:, -1]  # ties across a 64-element block
    nan = x.clone()
    nan[:, vocab // 2] = float("nan")
    nan[0, -1] = float("nan")
    zeros = torch.zeros(rows, vocab)
    zeros[:, : vocab // 2] = -0.0
    wide = torch.randn(rows, vocab + 9, generator=gen)
    cases = [x, tied, nan, zeros, -zeros, torch.full((rows, vocab), -float("inf")), wide[:, 4:-5]]
    for case in cases:
        assert torch.equal(KERNELS.argmax(case, threads), case.argmax(dim=-1))
    assert KERNELS.argmax(torch.zeros(0, vocab), threads).shape == (0,)
    with pytest.raises(ValueError, match="float32"):
        KERNELS.argmax(x.to(torch.bfloat16), threads)


def test_bad_inputs_are_refused_not_read_out_of_bounds() -> None:
    assert KERNELS is not None
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        KERNELS.add_rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-5, None)
    with pytest.raises(ValueError, match="residual"):
        KERNELS.add_rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-5, x.float())
    with pytest.raises(ValueError, match="silu_mul"):
        KERNELS.silu_mul(torch.randn(4, 63, dtype=torch.bfloat16))
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    table = torch.randn(8, 64, dtype=torch.float32)  # not q's dtype
    with pytest.raises(ValueError, match="rotary_neox"):
        KERNELS.rotary_neox(torch.zeros(2, dtype=torch.int64), q, q[:, :1], table, table)
    assert not KERNELS.takes_ops(torch.float16, 64)
    assert not KERNELS.takes_ops(torch.bfloat16, cpu_kernels.OPS_MAX_HIDDEN + 1)


def test_what_the_kernels_do_not_take_runs_the_torch_ops() -> None:
    assert KERNELS is not None
    ops, reference = CpuOps(KERNELS), TorchOps()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).to(torch.float16)
    weight = torch.rand(64, generator=g).to(torch.float16)
    pairs = zip(ops.norm(x, weight, 1e-5, x), reference.norm(x, weight, 1e-5, x), strict=True)
    for got, want in pairs:
        assert torch.equal(got, want)
    wide = torch.randn(2, cpu_kernels.OPS_MAX_HIDDEN + 16, generator=g).to(torch.bfloat16)
    ones = torch.ones(wide.shape[1], dtype=torch.bfloat16)
    assert torch.equal(ops.norm(wide, ones, 1e-5, None)[0], rms_norm(wide, ones, 1e-5))
    gate_up = torch.randn(2, 32, generator=g).to(torch.float16)
    assert torch.equal(ops.silu_mul(gate_up), reference.silu_mul(gate_up))


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    return Path(make_checkpoint(dtype="bfloat16"))


def test_the_cpu_backend_brings_its_ops_and_the_torch_backend_keeps_torch_ops(
    model_dir: Path,
) -> None:
    assert KERNELS is not None
    assert isinstance(ops_for(CpuAttentionBackend(KERNELS)), CpuOps)
    assert isinstance(ops_for(TorchAttentionBackend()), TorchOps)
    llm = LLM(model_dir, dtype="bfloat16", num_kv_blocks=32)
    try:
        assert isinstance(llm.engine.runner.model.ops, CpuOps)
    finally:
        llm.close()
