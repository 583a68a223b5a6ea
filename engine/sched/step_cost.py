"""What an engine step costs, learned online from the steps the engine runs.

The scheduler uses it to keep a step that mixes prefill chunks with decode rows within a
time target (`EngineConfig.tpot_target_ms`), as Sarathi-style chunking does: every
running stream waits for the whole step, so one long prompt prefilled in one step would
stall them all. The model is linear in the step's shape,

    seconds ~ a + b*decode_rows + c*decode_context + d*prefill_tokens + e*prefill_attention

(`decode_context`: the decode rows' KV lengths, which their attention reads;
`prefill_attention`: the query-key pairs of the prefill chunks), fitted by least squares
on recent steps with every coefficient kept >= 0 (so a longer chunk never predicts a
shorter step, and the scheduler's search for the largest chunk that fits is sound).

Robust to what disturbs wall times on a shared host: the fit weighs each step by its
relative error, so a step that a descheduled thread or a GC pause made 10x slower moves
it by at most as much as any other step, and such steps (over twice the first fit's
prediction) are then dropped from the fit. Steps with and without prefill are kept in
separate windows, so hours of pure decoding never forget what a prefill token costs.
Until enough steps with prefill were seen, `predict` returns None and the scheduler uses
its plain token budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepShape:
    """The cost-relevant size of one step (a scheduled batch)."""

    decode_rows: int = 0
    decode_context: int = 0  # sum of the decode rows' context lengths (KV read)
    prefill_tokens: int = 0
    prefill_attention: int = 0  # sum over prefill chunks of their query-key pairs

    def with_chunk(self, start: int, num_tokens: int) -> StepShape:
        """This shape plus a prefill chunk of `num_tokens` from position `start`."""
        return StepShape(
            self.decode_rows,
            self.decode_context,
            self.prefill_tokens + num_tokens,
            self.prefill_attention + chunk_attention(start, num_tokens),
        )

    def with_decode(self, context_len: int) -> StepShape:
        return StepShape(
            self.decode_rows + 1,
            self.decode_context + context_len,
            self.prefill_tokens,
            self.prefill_attention,
        )

    def features(self) -> tuple[float, float, float, float, float]:
        return (
            1.0,
            float(self.decode_rows),
            float(self.decode_context),
            float(self.prefill_tokens),
            float(self.prefill_attention),
        )


def chunk_attention(start: int, num_tokens: int) -> int:
    """Query-key pairs of a causal chunk: token i (from `start`) attends to start+i+1 keys."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepCostModel:
    """Online fit of step seconds from `StepShape`; `observe` each step, `predict` any.

    Single-threaded, like the engine that drives it. Refits lazily, at most once per
    `refit_every` new observations, so its cost per step is a deque append and, now and
    then, a least-squares solve on at most 2 * `window` rows of 5 numbers.
    """

    def __init__(
        self,
        window: int = 128,
        min_samples: int = 16,
        min_prefill_samples: int = 4,
        warmup_steps: int = 2,
        refit_every: int = 8,
    ) -> None:
        # steps with prefill tokens / steps without: both kinds stay represented
        self._with_prefill: deque[tuple[StepShape, float]] = deque(maxlen=window)
        self._without_prefill: deque[tuple[StepShape, float]] = deque(maxlen=window)
        self.min_samples = min_samples
        self.min_prefill_samples = min_prefill_samples
        self.refit_every = refit_every
        self._skip = warmup_steps  # first steps: allocation, kernel builds, cold caches
        self._since_fit = 0
        self._coef: tuple[float, ...] | None = None
        self._decode_since_fit = 0
        self._decode_coef: tuple[float, ...] | None = None
        self.num_observed = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        if self._skip > 0:
            self._skip -= 1
            return
        if seconds <= 0 or not np.isfinite(seconds):
            return
        window = self._with_prefill if shape.prefill_tokens else self._without_prefill
        window.append((shape, seconds))
        self.num_observed += 1
        self._since_fit += 1
        self._decode_since_fit += not shape.prefill_tokens

    @property
    def coefficients(self) -> tuple[float, ...] | None:
        """(a, b, c, d, e) in seconds per unit of `StepShape.features`, or None (no fit)."""
        if self._coef is None or self._since_fit >= self.refit_every:
            self._refit()
        return self._coef

    @property
    def decode_coefficients(self) -> tuple[float, ...] | None:
        """Coefficients for steps without prefill tokens: the full fit's when there is one,
        else a fit of (a, b, c) on the steps without prefill alone, with d = e = 0 (what
        a decode-heavy engine, which sees few prefills, still learns: speculative
        decoding's `SpecPolicy` prices its verify rows with it); None before either."""
        coef = self.coefficients
        if coef is not None:
            return coef
        if self._decode_coef is None or self._decode_since_fit >= self.refit_every:
            rows = list(self._without_prefill)
            if len(rows) >= self.min_samples:
                self._decode_since_fit = 0
                x = np.array([shape.features()[:3] for shape, _ in rows], dtype=np.float64)
                y = np.array([seconds for _, seconds in rows], dtype=np.float64)
                abc = _relative_nonneg_lstsq(x, y)
                self._decode_coef = (*(float(c) for c in abc), 0.0, 0.0)
        return self._decode_coef

    def predict(self, shape: StepShape) -> float | None:
        """Predicted seconds of a step of `shape`; None before there is enough data."""
        coef = self.coefficients
        if coef is None:
            return None
        return sum(c * x for c, x in zip(coef, shape.features(), strict=True))

    def _refit(self) -> None:
        num_prefill = len(self._with_prefill)
        if num_prefill + len(self._without_prefill) < self.min_samples:
            return  # keep the last fit, if any
        if num_prefill < self.min_prefill_samples:
            return
        self._since_fit = 0
        rows = [*self._with_prefill, *self._without_prefill]
        x = np.array([shape.features() for shape, _ in rows], dtype=np.float64)
        y = np.array([seconds for _, seconds in rows], dtype=np.float64)
        coef = _relative_nonneg_lstsq(x, y)
        predicted = x @ coef
        keep = y <= 2.0 * predicted  # spikes: a descheduled step, a GC pause
        if len(rows) - int(keep.sum()) > 0 and int(keep.sum()) >= self.min_samples:
            coef = _relative_nonneg_lstsq(x[keep], y[keep])
        self._coef = tuple(float(c) for c in coef)


def _relative_nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_{coef >= 0} sum(((y - x @ coef) / y)^2), by dropping negative coefficients.

    Relative errors: a 2 ms decode step and a 300 ms prefill step count alike, and a step
    far slower than predicted has a residual below 1. Columns are scaled to unit maximum
    first (context terms run to millions, the intercept is 1). Dropping the most negative
    coefficient and refitting until none is negative is not exact NNLS in general, but
    with five collinear-ish features it lands on the same active set in practice, and any
    result is non-negative, which is what the scheduler's search needs.
    """
    weighted = x / y[:, None]
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    weighted = weighted / scale
    target = np.ones_like(y)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(weighted[:, active], target, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        del active[int(np.argmin(sol))]
    return coef / scale
