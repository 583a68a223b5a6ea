"""Joint placement of a request's prefill and decode workers (docs/architecture.md, "Request path").

Input: for each candidate worker of a pool (every live one, or the index view's
shortlist), how many leading blocks of the prompt it holds and its load (heartbeat
gauges merged with what this router has in flight there, which the heartbeat has not seen
yet: `router/load.py`, the one place that reads a worker's load).
Output: the cheapest worker of each pool; ties are broken at random. A prefill worker's
cost is the time it would take to finish this prompt, its queue included, at its
measured rate (`router/disagg.py`): the one that finishes soonest is chosen, so a slow
or backed-up worker gets less. A request of a LoRA adapter costs more on a worker that
does not hold the adapter resident (`PlacementWeights.lora_load`): it goes where its
adapter is unless that worker is busier by more than a load is worth, and an adapter no
worker holds goes to one with a free adapter slot (its `lora_slots_free` gauge), the
least loaded. A prefix hit costs what using it costs: a block in the worker's device
pool nothing, one only in its host-memory or disk tier a copy at the rates the worker
measured and reports (`tier_cost_s`), weighed against computing the block at the
worker's prefill rate. `round-robin` and `random` ignore prefix, load and adapters, for
the benchmarks that measure what prefix-aware placement buys. Plain Python.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pdserve.cluster.config import Placement, PlacementWeights
from pdserve.cluster.prefix_index import MatchResult

HoldsLoRA = Callable[[MatchResult], bool]
"""Whether a worker holds a request's LoRA adapter resident (`LoadBook.holds_lora`)."""


@dataclass(frozen=True)
class Choice:
    """One chosen worker and the prompt blocks it already holds."""

    worker_id: str
    address: str
    matched_blocks: int


class Placer:
    """Picks a prefill and a decode worker for a prompt.

    Args:
        policy: "prefix-aware", "round-robin" or "random".
        weights: The decode-cost weights (prefill cost is in tokens, unweighted).
        block_size: Tokens per KV block.
        rng: Source of tie-breaking and `random` choices (seed it in tests).
    """

    def __init__(
        self,
        policy: Placement,
        weights: PlacementWeights,
        block_size: int,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy
        self.weights = weights
        self.block_size = block_size
        self.rng = rng or random.Random()
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}

    def choose_prefill(
        self,
        matches: Mapping[str, MatchResult],
        prompt_len: int,
        inflight_tokens: Mapping[str, int],
        rates: Mapping[str, float | None] | None = None,
        holds_lora: HoldsLoRA | None = None,
    ) -> Choice | None:
        """The prefill worker that would finish this prompt soonest.

        inflight_tokens: prompt tokens this router sent to each worker, not yet done.
        rates: each worker's prefill tokens per second (None or absent: not measured;
        then the cost is in tokens, as if all were equally fast).
        holds_lora: for a request of a LoRA adapter, whether a worker holds it resident.
        Returns None when no prefill worker is live.
        """
        rates = rates or {}
        load_tokens = self.weights.lora_load_tokens

        def cost(m: MatchResult) -> float:
            tokens = self.uncached_tokens(m, prompt_len) + queued_tokens(m, inflight_tokens)
            work = tokens + load_tokens * lora_loads(m, holds_lora)
            rate = rates.get(m.worker.worker_id)
            # unmeasured, costs are in tokens, and a tier's copy has no token price yet
            return work / rate + tier_cost_s(m) if rate else work

        return self._pick("prefill", list(matches.values()), cost)

    def uncached_tokens(self, m: MatchResult, prompt_len: int) -> int:
        """The prompt's tokens the worker would compute (it holds the rest)."""
        return prompt_len - min(m.matched_blocks * self.block_size, prompt_len)

    def hit_blocks(self, m: MatchResult, tokens_per_s: float | None) -> float:
        """The worker's matched blocks, less what copying its tiered ones back costs, in
        blocks it could compute in that time (at `tokens_per_s`; unmeasured, a tiered
        block counts as one in the pool). Never below 0: a hit is never worse than
        computing."""
        tier_s = tier_cost_s(m)
        if not tier_s or not tokens_per_s:
            return float(m.matched_blocks)
        return max(m.matched_blocks - tier_s * tokens_per_s / self.block_size, 0.0)

    def choose_decode(
        self,
        matches: Mapping[str, MatchResult],
        inflight_requests: Mapping[str, int],
        holds_lora: HoldsLoRA | None = None,
        rates: Mapping[str, float | None] | None = None,
    ) -> Choice | None:
        """The decode worker with the lowest weighted load minus its cached prefix.

        inflight_requests: requests this router has streaming from each worker.
        holds_lora: for a request of a LoRA adapter, whether a worker holds it resident.
        rates: each worker's prefill tokens per second, by which a hit in a lower tier
        counts for less than one in the pool (`hit_blocks`).
        Returns None when no decode worker is live.
        """
        w = self.weights
        rates = rates or {}

        def cost(m: MatchResult) -> float:
            load = m.worker.load
            running = decode_running(m, inflight_requests)
            total = max(load.get("kv_blocks_total", 0), 1)
            usage_pct = 100.0 * load.get("kv_blocks_used", 0) / total
            return (
                w.running * running
                + w.kv_usage * usage_pct
                - w.hit * self.hit_blocks(m, rates.get(m.worker.worker_id))
                + w.lora_load * lora_loads(m, holds_lora)
            )

        return self._pick("decode", list(matches.values()), cost)

    def _pick(
        self, pool: str, candidates: Sequence[MatchResult], cost: Callable[[MatchResult], float]
    ) -> Choice | None:
        if not candidates:
            return None
        ordered = sorted(candidates, key=lambda m: m.worker.worker_id)
        if self.policy == "round-robin":
            best = ordered[next(self._turns[pool]) % len(ordered)]
        elif self.policy == "random":
            best = self.rng.choice(ordered)
        else:
            costs = [cost(m) for m in ordered]
            lowest = min(costs)
            best = self.rng.choice([m for m, c in zip(ordered, costs, strict=True) if c == lowest])
        return Choice(best.worker.worker_id, best.worker.address, best.matched_blocks)


def tier_cost_s(m: MatchResult) -> float:
    """Seconds the worker takes to bring its matched blocks that are only in a lower
    tier back into its pool, at the per-block costs it measured and reports (a host
    block: one copy; a disk block: a read and its checksum, then the copy); 0 for blocks
    in the pool, or a tier it has not measured yet."""
    if not m.host_blocks and not m.disk_blocks:
        return 0.0
    load = m.worker.load
    promote_us = max(load.get("kv_host_promote_us_per_block", 0), 0)
    read_us = max(load.get("kv_disk_read_us_per_block", 0), 0)
    return (m.host_blocks * promote_us + m.disk_blocks * (read_us + promote_us)) / 1e6


def lora_loads(m: MatchResult, holds_lora: HoldsLoRA | None) -> int:
    """What placing a LoRA request on the worker costs in adapter loads: 0 where it holds
    the adapter (or the request has none), 1 where a slot is free for it, 2 where every
    slot serves running requests (the load must wait for one to finish)."""
    if holds_lora is None or holds_lora(m):
        return 0
    return 1 if m.worker.load.get("lora_slots_free", 1) > 0 else 2


def queued_tokens(m: MatchResult, inflight_tokens: Mapping[str, int]) -> int:
    """Prompt tokens ahead of a new one on the worker: its heartbeat's, or what this
    router sent it and has not seen done, whichever is more (the heartbeat lags)."""
    queued = max(m.worker.load.get("queued_prefill_tokens", 0), 0)
    return max(queued, inflight_tokens.get(m.worker.worker_id, 0))


def decode_running(m: MatchResult, inflight_requests: Mapping[str, int]) -> int:
    """Sequences on a decode worker: its heartbeat's, or this router's streams there."""
    load = m.worker.load
    running = load.get("running", 0) + load.get("waiting", 0)
    return max(running, inflight_requests.get(m.worker.worker_id, 0))
