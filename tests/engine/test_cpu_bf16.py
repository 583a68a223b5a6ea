"""The bf16-weight C linear (engine/cpu/bf16.py, csrc/bf16_linear.c): exact sums of the
widened weights, and each output the same whatever the batch and the thread count."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu import bf16 as cpu_bf16

KERNEL = cpu_bf16.load()
pytestmark = pytest.mark.skipif(
    KERNEL is None or not KERNEL.vectorised,
    reason="the bf16 C kernel builds vectorised only with AVX2 and FMA (x86-64)",
)


def _case(n: int, k: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    return weight, torch.randn(batch, k, generator=gen)


@pytest.mark.parametrize(
    ("n", "k"),
    [(48, 64), (40, 37), (7, 5), (64, 1)],  # whole panels, a partial one, tiny, K = 1
)
@pytest.mark.parametrize("batch", [1, 2, 3, 6, 13])
def test_sums_are_the_widened_weights_times_x(n: int, k: int, batch: int) -> None:
    assert KERNEL is not None
    weight, x = _case(n, k, batch, seed=n * 1000 + k)
    packed = KERNEL.pack(weight)
    assert packed.shape == (-(-n // cpu_bf16.PANEL), k, cpu_bf16.PANEL)
    assert torch.equal(KERNEL.unpack(packed, n), weight)
    y = KERNEL.linear(x, packed, n)
    assert y.dtype == torch.float32 and y.shape == (batch, n)
    exact = x.double() @ weight.double().T  # bf16 widens to float32 exactly
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5 * k)


def test_each_output_is_the_same_whatever_the_batch_and_threads() -> None:
    """A decode row (1 or 2 rows: the paired-panel path) gets a prefill row's sums (the
    6-row blocks), bit for bit; so do 1 and 2 threads."""
    assert KERNEL is not None
    weight, x = _case(200, 96, 15, seed=7)
    packed = KERNEL.pack(weight)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = KERNEL.linear(x, packed, 200)
        torch.set_num_threads(2)
        together = KERNEL.linear(x, packed, 200)
        alone = torch.cat([KERNEL.linear(x[i : i + 1], packed, 200) for i in range(15)])
        pairs = torch.cat([KERNEL.linear(x[i : i + 2], packed, 200) for i in range(0, 14, 2)])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, one_thread)
    assert torch.equal(alone, together)
    assert torch.equal(pairs, together[:14])


def test_x_of_any_float_dtype_and_stride_and_bad_shapes() -> None:
    assert KERNEL is not None
    weight, x = _case(32, 24, 4, seed=3)
    packed = KERNEL.pack(weight)
    wide = torch.zeros(4, 40)
    wide[:, :24] = x
    torch.testing.assert_close(
        KERNEL.linear(wide[:, :24], packed, 32), KERNEL.linear(x, packed, 32)
    )
    xb = x.to(torch.bfloat16)
    assert torch.equal(KERNEL.linear(xb, packed, 32), KERNEL.linear(xb.float(), packed, 32))
    with pytest.raises(ValueError, match="does not fit"):
        KERNEL.linear(torch.zeros(2, 25), packed, 32)
    with pytest.raises(ValueError, match="2-d bf16"):
        KERNEL.pack(weight.float())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 2, 3, 13])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_in_and_out_equals_the_float32_call_rounded(
    threads: int, batch: int, with_bias: bool
) -> None:
    """`linear_bf16` (the model's dtype in and out, the conversions inside the C call) is
    `linear` plus the bias, `.to(bfloat16)`, bit for bit: NaN and infinity included,
    x strided, a partial last panel, a decode's row or two and a prefill's block."""
    assert KERNEL is not None
    weight, x32 = _case(40, 37, batch, seed=batch * 10 + threads)
    packed = KERNEL.pack(weight)
    wide = torch.zeros(batch, 45, dtype=torch.bfloat16)
    wide[:, 3:40] = x32.to(torch.bfloat16)
    if batch > 2:
        wide[1, 5] = float("inf")
        wide[2, 7] = float("nan")
    x = wide[:, 3:40]  # rows 45 apart
    bias = torch.randn(40, generator=torch.Generator().manual_seed(5)) if with_bias else None
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = KERNEL.linear_bf16(x, packed, 40, bias)
        want = KERNEL.linear(x, packed, 40)
    finally:
        torch.set_num_threads(previous)
    if bias is not None:
        want += bias
    want = want.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (batch, 40)
    both_nan = got.isnan() & want.isnan()
    assert (got.isnan() == want.isnan()).all()
    assert torch.equal(got.view(torch.int16)[~both_nan], want.view(torch.int16)[~both_nan])
    with pytest.raises(ValueError, match="bfloat16"):
        KERNEL.linear_bf16(x32, packed, 40)
    with pytest.raises(ValueError, match="bias"):
        KERNEL.linear_bf16(x, packed, 40, torch.zeros(39))
