"""The two forms of a step's LoRA deltas (engine/lora/apply.py): stacked and segmented
add the same delta to each row as the adapter's own arithmetic, rows of no adapter get
none, and `LoRAStep.of` picks stacked for many adapters' few rows and segmented for a
long run of rows of one adapter."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.lora.adapter import LoRAAdapter
from pdserve.engine.lora.apply import FUSED_PARTS, LoRAStack, LoRAStep

# (in, out) of each projection of a small model: hidden 16, 2 KV heads of 4, FFN 32
SHAPES = {
    "q_proj": (16, 16),
    "k_proj": (16, 8),
    "v_proj": (16, 8),
    "o_proj": (16, 16),
    "gate_proj": (16, 32),
    "up_proj": (16, 32),
    "down_proj": (32, 16),
}
LAYERS = 2
# fused projection -> (in features, widths of its parts)
FUSED = {
    "qkv": (16, [16, 8, 8]),
    "o": (16, [16]),
    "gate_up": (16, [32, 32]),
    "down": (32, [16]),
}
CPU = torch.device("cpu")


def _adapter(name: str, rank: int, modules: list[str], scaling: float, seed: int) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = tuple(
        {
            m: (
                torch.randn(rank, SHAPES[m][0], generator=gen),
                torch.randn(SHAPES[m][1], rank, generator=gen),
            )
            for m in modules
        }
        for _ in range(LAYERS)
    )
    return LoRAAdapter(name, f"/adapters/{name}", rank, scaling, frozenset(modules), weights)


ADAPTERS = [
    _adapter("qv4", 4, ["q_proj", "v_proj"], 2.0, 1),
    _adapter("all8", 8, list(SHAPES), 0.7, 2),
    _adapter("mlp16", 16, ["o_proj", "gate_proj", "up_proj", "down_proj"], 1.3, 3),
]


def _reference(
    rows: dict[int, LoRAAdapter], layer: int, fused: str, x: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Row by row, each adapter's own arithmetic in float64."""
    want = out.double().clone()
    _, widths = FUSED[fused]
    for row, adapter in rows.items():
        start = 0
        for module, width in zip(FUSED_PARTS[fused], widths, strict=True):
            ab = adapter.weights[layer].get(module)
            if ab is not None:
                a, b = (t.double() for t in ab)
                delta = adapter.scaling * ((x[row].double() @ a.t()) @ b.t())
                want[row, start : start + width] += delta
            start += width
    return want


def _step(
    rows: dict[int, LoRAAdapter], num_rows: int, stacked: bool
) -> tuple[LoRAStep, LoRAStack | None]:
    groups: dict[str, list[int]] = {}
    for row, adapter in sorted(rows.items()):
        groups.setdefault(adapter.name, []).append(row)
    by_name = {a.name: a for a in ADAPTERS}
    pairs = [(by_name[name], r) for name, r in groups.items()]
    made: list[LoRAStack] = []

    def stack_for(adapters: list[LoRAAdapter]) -> LoRAStack:
        made.append(LoRAStack(adapters))
        return made[-1]

    step = LoRAStep.of(pairs, CPU, num_rows, stack_for if stacked else None)
    assert step is not None
    return step, (made[0] if made else None)


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "segmented"])
def test_each_row_gets_its_own_adapters_delta(stacked: bool) -> None:
    num_rows = 11
    rows = {0: ADAPTERS[0], 2: ADAPTERS[1], 3: ADAPTERS[2], 4: ADAPTERS[0], 7: ADAPTERS[2]}
    rows |= {9: ADAPTERS[1], 10: ADAPTERS[1]}  # rows 1, 5, 6, 8: the base model
    step, stack = _step(rows, num_rows, stacked)
    assert (step.stack is not None) == stacked and (stack is not None) == stacked
    gen = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        for fused, (fan_in, widths) in FUSED.items():
            x = torch.randn(num_rows, fan_in, generator=gen)
            out = torch.randn(num_rows, sum(widths), generator=gen)
            want = _reference(rows, layer, fused, x, out)
            base = out.clone()
            step.add(layer, fused, x, out, widths if len(widths) > 1 else None)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
            for row in (1, 5, 6, 8):  # exactly the base's output
                assert torch.equal(out[row], base[row])


def test_many_adapters_few_rows_go_stacked_a_long_prompt_of_one_segmented() -> None:
    decode = {row: ADAPTERS[row % 3] for row in range(12)}
    step, _ = _step(decode, 12, stacked=True)
    assert step.stack is not None
    prompt = {row: ADAPTERS[2] for row in range(4000)} | {4000: ADAPTERS[0], 4001: ADAPTERS[1]}
    step, stack = _step(prompt, 4002, stacked=True)
    assert step.stack is None and stack is None and len(step.groups) == 3


def test_a_stack_stands_only_for_the_adapters_loaded_now() -> None:
    stack = LoRAStack(ADAPTERS[:2])
    loaded = {a.name: a for a in ADAPTERS}
    assert stack.holds(loaded)
    reloaded = _adapter("qv4", 4, ["q_proj", "v_proj"], 2.0, 1)  # unloaded, loaded again
    assert not stack.holds({**loaded, "qv4": reloaded})
    assert not stack.holds({"all8": ADAPTERS[1]})
