"""Measured prefill throughput: prompt tokens per second of busy time.

A prefill worker measures its own (and publishes it with its heartbeat); the router
measures each decode worker's local prefills and, as a fallback, each prefill worker's
calls (`router/disagg.py`). Both feed the time estimates of placement and conditional
disaggregation. Plain Python.

Why busy time, not per request: a worker prefills several prompts in one step, and each
of them takes the whole step. Dividing each prompt's tokens by its own compute time
would undercount a batch of two by half; dividing the tokens by the union of the
intervals counts the time the worker really spent.
"""

from __future__ import annotations


class RateMeter:
    """Tokens per busy second over the recent observations (an exponential average).

    Args:
        decay: Weight the past keeps at each new stretch of busy time (0.8: about the
            last five); prompts prefilled in the same stretch count as one.
        min_tokens: Smaller observations are ignored: a prompt of a few tokens costs
            the step's fixed overhead, and its rate says nothing about a long prompt's
            (`pdserve up`'s one-token readiness probe would otherwise set the first rate).
    """

    def __init__(self, decay: float = 0.8, min_tokens: int = 64) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.min_tokens = min_tokens
        self._tokens = 0.0
        self._busy_s = 0.0
        self._last_end_s = float("-inf")

    def add(self, tokens: int, start_s: float, end_s: float) -> None:
        """`tokens` prompt tokens computed between `start_s` and `end_s` (monotonic)."""
        if tokens < self.min_tokens or end_s <= start_s:
            return
        # only the part of the interval not counted yet (it overlaps a batch-mate's)
        busy = max(end_s - max(start_s, self._last_end_s), 0.0)
        self._last_end_s = max(self._last_end_s, end_s)
        if busy > 0.0:  # new busy time: the past weighs less; a batch-mate's tokens join it
            self._tokens *= self.decay
            self._busy_s *= self.decay
        self._tokens += tokens
        self._busy_s += busy

    @property
    def tokens_per_s(self) -> float | None:
        """None until an observation counted."""
        if self._busy_s <= 0.0:
            return None
        return self._tokens / self._busy_s
