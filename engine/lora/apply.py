"""A step's LoRA deltas: rows of several adapters (and of none) in one forward.

`LoRAStep.of(groups)` takes, for each adapter present in the step, the rows (token
positions of the flat batch) that belong to it; rows of no adapter get nothing. After
each projection the model calls `add` with the projection's input and output: for each
adapter, its rows' input is gathered once, multiplied down by A and up by B (per part of
a fused projection: q, k and v of `qkv`, gate and up of `gate_up`) and added into the
output's columns of that part. This is the segmented form of Punica's SGMV on CPU: one
small matmul pair per adapter and projection, whatever the mix of adapters in the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.lora.adapter import TARGETS, LoRAAdapter

# Each fused projection of the model and the modules of its parts, in column order.
FUSED_PARTS: dict[str, tuple[str, ...]] = {}
for _module, (_fused, _index) in sorted(TARGETS.items(), key=lambda kv: kv[1]):
    FUSED_PARTS.setdefault(_fused, ())
    FUSED_PARTS[_fused] = (*FUSED_PARTS[_fused], _module)


@dataclass(frozen=True)
class LoRAStep:
    """The adapters of one step and each one's rows (an int64 index tensor)."""

    groups: tuple[tuple[LoRAAdapter, torch.Tensor], ...]

    @staticmethod
    def of(
        rows: Sequence[tuple[LoRAAdapter, Sequence[int]]], device: torch.device
    ) -> LoRAStep | None:
        """The step for these (adapter, rows) pairs; None when no row has an adapter."""
        groups = tuple(
            (adapter, torch.tensor(list(r), dtype=torch.int64, device=device))
            for adapter, r in rows
            if r
        )
        return LoRAStep(groups) if groups else None

    def add(
        self,
        layer: int,
        fused: str,
        x: torch.Tensor,
        out: torch.Tensor,
        widths: Sequence[int] | None = None,
    ) -> None:
        """Add every adapter's delta of fused projection `fused` of `layer` into `out`
        ([T, sum(widths)]) for its rows of `x` ([T, in]). `widths`: the columns of each
        part (None: one part, every column)."""
        parts = FUSED_PARTS[fused]
        widths = [out.shape[1]] if widths is None else list(widths)
        for adapter, rows in self.groups:
            modules = adapter.weights[layer]
            if not any(m in modules for m in parts):
                continue
            xs = x.index_select(0, rows)
            start = 0
            for module, width in zip(parts, widths, strict=True):
                ab = modules.get(module)
                if ab is not None:
                    a, b = ab
                    delta = (xs.to(a.dtype) @ a.t()) @ b.t()
                    delta.mul_(adapter.scaling)
                    out[:, start : start + width].index_add_(0, rows, delta.to(out.dtype))
                start += width
