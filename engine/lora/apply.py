"""A step's LoRA deltas: rows of several adapters (and of none) in one forward.

`LoRAStep.of(groups, ...)` takes, for each adapter present in the step, the rows (token
positions of the flat batch) that belong to it; rows of no adapter get nothing. After
each projection the model calls `add` with the projection's input and output, and the
step adds every adapter's delta `scaling * (x A^T) B^T` to its rows, in one of two forms:

- segmented (Punica's SGMV, on CPU): per adapter, its rows' input is gathered, multiplied
  down by A and up by B (per part of a fused projection: q, k and v of `qkv`, gate and up
  of `gate_up`) and added into its rows of the output. Exactly the delta's arithmetic,
  but a handful of small operations per adapter, projection and layer.
- stacked: every adapter of the step side by side (`LoRAStack`, built once per set of
  adapters and kept by the runner): all rows go down through every adapter's A in one
  matmul, a mask keeps each row's own adapter's columns times its scaling, and one
  matmul per part goes up through the B's, added into the output as it goes. A fixed handful of
  operations whatever the number of adapters, at the price of computing every row
  against every adapter.

A decode step of many adapters' rows (few rows each) is cheapest stacked; a prompt's
long run of rows of one adapter, next to others, segmented. `LoRAStep.of` weighs the two
(`_GROUP_COST`). The masked columns add exact zeros: the forms differ only in rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.lora.adapter import TARGETS, LoRAAdapter

# Each fused projection of the model and the modules of its parts, in column order.
FUSED_PARTS: dict[str, tuple[str, ...]] = {}
for _module, (_fused, _index) in sorted(TARGETS.items(), key=lambda kv: kv[1]):
    FUSED_PARTS.setdefault(_fused, ())
    FUSED_PARTS[_fused] = (*FUSED_PARTS[_fused], _module)

# What one adapter costs a step in segmented form beyond its arithmetic (the gather,
# the scatter, a small matmul pair per part: ~10 operations per projection and layer),
# in the unit of the arithmetic: rows x rank. On the `mid` model at 2 threads an
# operation's fixed cost (~5-10 us) is ~2,000 such units of its matmuls.
_GROUP_COST = 2048


@dataclass(frozen=True)
class _Part:
    """One part of a fused projection in a stack: its A columns and B."""

    columns: slice  # of the stacked down projection's output
    out: slice  # of the fused projection's output
    b: torch.Tensor  # [part's out features, columns]: its adapters' B side by side


@dataclass(frozen=True)
class _Stacked:
    """One fused projection of one layer, every adapter of a stack side by side."""

    a: torch.Tensor  # [R, in]: the adapters' A of every part, stacked
    parts: tuple[_Part, ...]
    layout: tuple[tuple[int, int], ...]  # (adapter index, rank) of each column run
    owner: torch.Tensor  # [R]: the adapter index of each column


class LoRAStack:
    """A set of adapters stacked per layer and fused projection, for the stacked form.

    Built lazily, one projection at a time, by the first step that needs it; a runner
    keeps the last few stacks (the same adapters decode step after step)."""

    def __init__(self, adapters: Sequence[LoRAAdapter]) -> None:
        self.adapters = tuple(adapters)
        self.index = {a.name: i for i, a in enumerate(self.adapters)}
        self._stacked: dict[tuple[int, str], _Stacked | None] = {}

    def holds(self, loaded: dict[str, LoRAAdapter]) -> bool:
        """Every adapter of the stack is still the one loaded under its name."""
        return all(loaded.get(a.name) is a for a in self.adapters)

    def stacked(self, layer: int, fused: str, widths: Sequence[int]) -> _Stacked | None:
        key = (layer, fused)
        if key not in self._stacked:
            self._stacked[key] = self._stack(layer, fused, widths)
        return self._stacked[key]

    def _stack(self, layer: int, fused: str, widths: Sequence[int]) -> _Stacked | None:
        a_parts: list[torch.Tensor] = []
        parts: list[_Part] = []
        layout: list[tuple[int, int]] = []
        owners: list[int] = []
        column = out = 0
        for module, width in zip(FUSED_PARTS[fused], widths, strict=True):
            start = column
            bs = []
            for i, adapter in enumerate(self.adapters):
                ab = adapter.weights[layer].get(module)
                if ab is None:
                    continue
                a, b = ab
                a_parts.append(a)
                bs.append(b)
                layout.append((i, adapter.rank))
                owners += [i] * adapter.rank
                column += adapter.rank
            if bs:
                b_all = torch.cat(bs, dim=1).contiguous()
                parts.append(_Part(slice(start, column), slice(out, out + width), b_all))
            out += width
        if not parts:
            return None
        device = a_parts[0].device
        return _Stacked(
            a=torch.cat(a_parts, dim=0).contiguous(),
            parts=tuple(parts),
            layout=tuple(layout),
            owner=torch.tensor(owners, dtype=torch.int64, device=device),
        )


@dataclass
class LoRAStep:
    """The adapters of one step and each one's rows: segmented (`groups`), or stacked
    (`stack`, each row's adapter index in it, -1 for none, and its adapter's scaling)."""

    groups: tuple[tuple[LoRAAdapter, torch.Tensor], ...]
    stack: LoRAStack | None = None
    row_owner: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None  # [T, 1] float32
    _masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def of(
        rows: Sequence[tuple[LoRAAdapter, Sequence[int]]],
        device: torch.device,
        num_rows: int = 0,
        stack_for: Callable[[list[LoRAAdapter]], LoRAStack] | None = None,
    ) -> LoRAStep | None:
        """The step for these (adapter, rows) pairs of a forward of `num_rows` rows; None
        when no row has an adapter. Stacked when `stack_for` (the runner's stack of a set
        of adapters) is given and that form costs less (module docstring)."""
        present = [(adapter, list(r)) for adapter, r in rows if r]
        if not present:
            return None
        if stack_for is not None:
            stacked_cost = num_rows * sum(a.rank for a, _ in present)
            segmented_cost = sum(len(r) * a.rank + _GROUP_COST for a, r in present)
            if stacked_cost <= segmented_cost:
                stack = stack_for([a for a, _ in present])
                owner, scale = [-1] * num_rows, [0.0] * num_rows
                for adapter, r in present:
                    index = stack.index[adapter.name]
                    for row in r:
                        owner[row], scale[row] = index, adapter.scaling
                row_owner = torch.tensor(owner, dtype=torch.int64, device=device)
                row_scale = torch.tensor(scale, dtype=torch.float32, device=device)
                return LoRAStep((), stack, row_owner, row_scale.unsqueeze(1))
        groups = tuple(
            (adapter, torch.tensor(r, dtype=torch.int64, device=device)) for adapter, r in present
        )
        return LoRAStep(groups)

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
        widths = [out.shape[1]] if widths is None else list(widths)
        if self.stack is not None:
            self._add_stacked(layer, fused, x, out, widths)
            return
        parts = FUSED_PARTS[fused]
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

    def _add_stacked(
        self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor, widths: list[int]
    ) -> None:
        assert self.stack is not None and self.row_scale is not None
        stacked = self.stack.stacked(layer, fused, widths)
        if stacked is None:
            return
        down = x.to(stacked.a.dtype) @ stacked.a.t()  # [T, R]: every row, every adapter
        # each row its own adapter's columns, times its scaling (in float32: one rounding
        # of the product, as the segmented form's scalar)
        down.mul_(self._mask(stacked))
        for part in stacked.parts:
            target = out[:, part.out]
            if down.dtype == out.dtype:
                target.addmm_(down[:, part.columns], part.b.t())
            else:
                target.add_((down[:, part.columns] @ part.b.t()).to(out.dtype))

    def _mask(self, stacked: _Stacked) -> torch.Tensor:
        """[T, R] float32: a row's scaling in its own adapter's columns, 0 elsewhere (one
        per column layout: every layer of a stack has the same, unless an adapter skips
        one)."""
        mask = self._masks.get(stacked.layout)
        if mask is None:
            assert self.row_owner is not None and self.row_scale is not None
            own = self.row_owner.unsqueeze(1) == stacked.owner.unsqueeze(0)
            mask = own.to(torch.float32) * self.row_scale
            self._masks[stacked.layout] = mask
        return mask
