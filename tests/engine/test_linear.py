"""`Linear`: weights packed for oneDNN once at load; a bf16 weight widened to float32 on a
CPU without bf16 matmul (engine/modeling/linear.py's docstring)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.cpu import bf16 as cpu_bf16
from pdserve.engine.modeling import linear
from pdserve.engine.modeling.linear import Linear

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


HAS_BF16_KERNEL = (kernel := cpu_bf16.load()) is not None and kernel.vectorised


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "path",
    [
        pytest.param(
            "kernel",
            marks=pytest.mark.skipif(
                not HAS_BF16_KERNEL, reason="the bf16 C kernel needs AVX2 and FMA"
            ),
        ),
        "widened",
    ],
)
def test_bf16_without_bf16_matmul_computes_in_float32(
    monkeypatch: pytest.MonkeyPatch, with_bias: bool, path: str
) -> None:
    monkeypatch.setattr(linear, "cpu_has_bf16_matmul", lambda: False)
    if path == "widened":  # no C kernel (no compiler, PDSERVE_CPU_KERNELS=0)
        monkeypatch.setattr(linear, "_bf16_kernel", lambda weight: None)
    weight, x = _bf16(48, 64, seed=0), _bf16(7, 64, seed=1)
    bias = _bf16(48, seed=2) if with_bias else None
    lin = Linear(weight, bias)
    assert lin.packed is not None and lin.weight is None
    bias_bytes = 48 * 4 if with_bias else 0  # float32: added to the float32 sums
    if path == "kernel":
        # Held as bf16, packed for the kernel: the checkpoint's bytes
        assert lin.kernel is not None and not lin.widened
        assert lin.weight_bytes == 48 * 64 * 2 + bias_bytes
        assert lin.row_bytes == 64 * 2 + (4 if with_bias else 0)
    else:
        # Held as float32: twice the bf16 bytes, and counted so by the memory profile.
        assert lin.kernel is None and lin.widened
        assert lin.weight_bytes == 48 * 64 * 4 + bias_bytes
        assert lin.row_bytes == (64 + with_bias) * 4

    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (7, 48)
    # bf16 operands, float32 sums, rounded once to bf16: a native bf16 matmul's result,
    # up to the order of the sums (one bf16 step at most).
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(y.float(), exact, rtol=2**-7, atol=1e-3)
    # Each row's result depends on that row alone (a decode row gets a prefill row's sums).
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(7)]), y)


def test_bf16_with_bf16_matmul_stays_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    if not linear.cpu_has_bf16_matmul():
        # The packed-bf16 path needs the instructions; only the decision is checked here.
        monkeypatch.setattr(linear, "cpu_has_bf16_matmul", lambda: True)
        assert linear._pack_dtype(_bf16(4, 4, seed=0)) == torch.bfloat16
        return
    lin = Linear(_bf16(48, 64, seed=0))
    assert not lin.widened and lin.packed is not None
    assert lin.weight_bytes == 48 * 64 * 2


def test_float32_and_float16_are_never_widened() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 32, generator=gen)
    x = torch.randn(3, 32, generator=gen)
    lin32 = Linear(weight)
    assert not lin32.widened and lin32.packed is not None
    torch.testing.assert_close(lin32(x), F.linear(x, weight))
    lin16 = Linear(weight.half())
    assert not lin16.widened and lin16.packed is None and lin16.weight is not None
