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
