"""Sizing both pools to latency targets from a performance model (the planner's math).

The planner (`router/planner_loop.py` runs it) turns what the routers observed of the
traffic and what the workers measured of their own steps into a replica count per pool:
the fewest that meet a TTFT and an inter-token latency target at a percentile, with
headroom, within each pool's bounds and a replica budget. Plain Python, no I/O.

The model (documented in docs/planner.md, with its limits):

- **Workers' step cost.** Each engine fits its step time as
  `a + b*decode_rows + c*decode_context + d*prefill_tokens` (engine/sched/step_cost.py)
  and publishes the coefficients with its heartbeat; a pool's model is the median of its
  workers'. Before any worker has a fit, `Defaults` stand in.
- **Prefill pool** (disaggregated). Prompt work arrives at
  `rate * prompt * (1 - hit) * (1 - local)` tokens/s (`local`: the share of prompt
  tokens decode workers prefilled themselves). A prompt's service time is
  `S = a + d * uncached prompt`; a replica is busy `rho = arrivals * S / n` of the time,
  and a prompt waits, at percentile q, as in an M/M/1 queue per replica:
  `S / (1 - rho) * ln(rho / (1 - q))` when that is positive. TTFT = wait + S + one
  decode step (the first token's trip).
- **Decode pool.** A request streams `output` tokens, one per step, so by Little's law
  `running = rate * output * ITL` sequences run, `running / n` per replica, each with
  about `prompt + output / 2` tokens of context. Decode steps take
  `ITL = a + (b + c * context) * running / n`, and the prompts decode workers prefill
  themselves take a share `f` of their time, which stretches every step: `ITL / (1 - f)`.
  Solved for ITL: `ITL = a / (1 - f - (b + c * context) * rate * output / n)`. The KV the
  running sequences hold must fit `kv_usage` of the pool's blocks. In colocated mode
  every prompt is prefilled there, and TTFT is that prefill's wait (as above, on the
  decode pool, busy `f`) plus its time.
- **Headroom.** A count meets its targets when the predictions are within `headroom` of
  them (0.8: 20% spare), and the rate it plans for is the forecast (`forecast_rate`).

Decisions are the smallest counts meeting both targets, then cut to the budget (the
pool whose prediction suffers least gives a replica first).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median


@dataclass(frozen=True)
class Traffic:
    """What the routers observed over the last window."""

    rate: float  # requests per second
    prompt_tokens: float  # mean per request
    output_tokens: float  # mean per request
    hit: float = 0.0  # share of prompt tokens served from a prefix cache
    local: float = 0.0  # share of computed prompt tokens prefilled on decode workers


@dataclass(frozen=True)
class StepCost:
    """One worker's step cost, in seconds: fixed, per decode row, per context token read
    by a decode row, per prefill token (engine/sched/step_cost.py's a, b, c, d)."""

    fixed: float
    per_row: float
    per_context: float
    per_prefill_token: float

    @staticmethod
    def median_of(costs: list[StepCost]) -> StepCost | None:
        if not costs:
            return None
        return StepCost(
            median(c.fixed for c in costs),
            median(c.per_row for c in costs),
            median(c.per_context for c in costs),
            median(c.per_prefill_token for c in costs),
        )


@dataclass(frozen=True)
class Defaults:
    """The step cost assumed before a pool's workers have measured theirs (a small model
    on a few CPU cores; the first measurements replace it within seconds of traffic)."""

    step: StepCost = StepCost(0.005, 0.0005, 1e-7, 0.0005)


@dataclass(frozen=True)
class Bounds:
    min_replicas: int = 1
    max_replicas: int = 4

    def clamp(self, n: int) -> int:
        return min(max(n, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class Targets:
    ttft_s: float | None
    itl_s: float | None
    percentile: float = 0.9  # of requests (TTFT) and of tokens (ITL)
    headroom: float = 0.8  # meet the targets within this share of them


@dataclass(frozen=True)
class Prediction:
    """What a count is predicted to give (None: cannot keep up at all)."""

    replicas: int
    ttft_s: float | None = None
    itl_s: float | None = None
    utilization: float = 0.0

    def as_json(self) -> dict[str, float | int | None]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

        return {
            "replicas": self.replicas,
            "ttft_s": r(self.ttft_s),
            "itl_s": r(self.itl_s),
            "utilization": round(self.utilization, 3),
        }


@dataclass(frozen=True)
class Plan:
    """The counts chosen and every candidate's prediction, per pool."""

    prefill: int | None  # None: no prefill pool (colocated)
    decode: int
    candidates: dict[str, list[Prediction]] = field(default_factory=dict)
    budget_cut: bool = False


def queue_wait_s(service_s: float, rho: float, percentile: float) -> float | None:
    """The wait at `percentile` in an M/M/1 queue of utilization `rho` whose service takes
    `service_s` on average; None when `rho` >= 1 (the queue grows without bound)."""
    if rho >= 1.0:
        return None
    if rho <= 0.0 or rho <= 1.0 - percentile:
        return 0.0
    return service_s / (1.0 - rho) * math.log(rho / (1.0 - percentile))


def predict_prefill(
    traffic: Traffic, step: StepCost, decode: StepCost, n: int, q: float
) -> Prediction:
    """A prefill pool of `n` replicas (disaggregated)."""
    remote_rate = traffic.rate * (1.0 - traffic.local)
    uncached = traffic.prompt_tokens * (1.0 - traffic.hit)
    service = step.fixed + step.per_prefill_token * uncached
    rho = remote_rate * service / n
    wait = queue_wait_s(service, rho, q)
    ttft = None if wait is None else wait + service + decode.fixed
    return Prediction(n, ttft_s=ttft, utilization=rho)


def predict_decode(
    traffic: Traffic, step: StepCost, n: int, q: float, colocated: bool
) -> Prediction:
    """A decode pool of `n` replicas; in colocated mode it prefills every prompt."""
    local = 1.0 if colocated else traffic.local
    uncached = traffic.prompt_tokens * (1.0 - traffic.hit)
    prefill_s = step.per_prefill_token * uncached
    f = traffic.rate * local * prefill_s / n  # the share of time spent prefilling
    context = traffic.prompt_tokens + traffic.output_tokens / 2.0
    per_seq = step.per_row + step.per_context * context
    spare = 1.0 - f - per_seq * traffic.rate * traffic.output_tokens / n
    itl = None if spare <= 0.0 else step.fixed / spare
    ttft = None
    if colocated and itl is not None:
        service = prefill_s + step.fixed
        wait = queue_wait_s(service, f, q)
        ttft = None if wait is None else wait + service
    return Prediction(n, ttft_s=ttft, itl_s=itl, utilization=max(f, 1.0 - spare))


def _meets(p: Prediction, targets: Targets, ttft: bool, itl: bool) -> bool:
    room = targets.headroom

    def within(value: float | None, target: float | None) -> bool:
        return target is None or (value is not None and value <= room * target)

    return (not ttft or within(p.ttft_s, targets.ttft_s)) and (
        not itl or within(p.itl_s, targets.itl_s)
    )


def plan(
    traffic: Traffic,
    targets: Targets,
    prefill_step: StepCost | None,
    decode_step: StepCost,
    prefill_bounds: Bounds | None,
    decode_bounds: Bounds,
    budget: int | None = None,
    kv_tokens_per_replica: float | None = None,
    kv_usage: float = 0.9,
) -> Plan:
    """The counts for `traffic` (`prefill_bounds` None: colocated, no prefill pool).

    `kv_tokens_per_replica`: a decode replica's KV capacity in tokens (None: unknown,
    unchecked); the running sequences' context must fit `kv_usage` of it.
    """
    q = targets.percentile
    colocated = prefill_bounds is None
    decode_preds = [
        predict_decode(traffic, decode_step, n, q, colocated)
        for n in range(decode_bounds.min_replicas, decode_bounds.max_replicas + 1)
    ]
    running = traffic.rate * traffic.output_tokens
    context = traffic.prompt_tokens + traffic.output_tokens / 2.0

    def decode_ok(p: Prediction) -> bool:
        if kv_tokens_per_replica is not None and p.itl_s is not None:
            held = running * p.itl_s * context / p.replicas
            if held > kv_usage * kv_tokens_per_replica:
                return False
        return _meets(p, targets, ttft=colocated, itl=True)

    decode = _smallest(decode_preds, decode_ok, decode_bounds)
    candidates = {"decode": decode_preds}
    prefill = None
    if prefill_bounds is not None:
        step = prefill_step if prefill_step is not None else decode_step
        prefill_preds = [
            predict_prefill(traffic, step, decode_step, n, q)
            for n in range(prefill_bounds.min_replicas, prefill_bounds.max_replicas + 1)
        ]
        candidates["prefill"] = prefill_preds
        prefill = _smallest(
            prefill_preds, lambda p: _meets(p, targets, ttft=True, itl=False), prefill_bounds
        )
    cut = False
    if budget is not None:
        p_min = prefill_bounds.min_replicas if prefill_bounds is not None else 0
        p = prefill or 0
        while p + decode > budget:
            cut = True
            give_prefill = p > p_min and (
                decode <= decode_bounds.min_replicas
                or _slack(candidates.get("prefill", []), p - 1, "ttft_s", targets.ttft_s)
                >= _slack(candidates["decode"], decode - 1, "itl_s", targets.itl_s)
            )
            if give_prefill:
                p -= 1
            elif decode > decode_bounds.min_replicas:
                decode -= 1
            else:
                break  # the minimums alone exceed the budget: they win
        if prefill is not None:
            prefill = p
    return Plan(prefill, decode, candidates, cut)


def _smallest(preds: list[Prediction], ok: Callable[[Prediction], bool], bounds: Bounds) -> int:
    """The smallest count whose prediction is `ok`; the largest allowed if none is."""
    for p in preds:
        if ok(p):
            return p.replicas
    return bounds.max_replicas


def _slack(preds: list[Prediction], n: int, what: str, target: float | None) -> float:
    """How far under its target a pool of `n` replicas is predicted (larger: better;
    -inf where it cannot keep up)."""
    p = next((p for p in preds if p.replicas == n), None)
    value = None if p is None else getattr(p, what)
    if value is None:
        return -math.inf
    return math.inf if target is None else 1.0 - value / target


SMOOTH = 3  # windows averaged for the current rate (one window's count is noisy)


def forecast_rate(history: list[tuple[float, float]], horizon_s: float) -> float:
    """The request rate `horizon_s` ahead. The current rate is the mean of the last
    SMOOTH windows'; while the rate rises (a least squares line through `history`'s
    (time, rate) points has a positive slope), the line's value `horizon_s` past the
    last window, if higher. A falling rate is followed as the mean falls, not
    anticipated."""
    if not history:
        return 0.0
    recent = [r for _, r in history[-SMOOTH:]]
    current = sum(recent) / len(recent)
    if len(history) < 3:
        return current
    ts = [t for t, _ in history]
    rs = [r for _, r in history]
    mt, mr = sum(ts) / len(ts), sum(rs) / len(rs)
    var = sum((t - mt) ** 2 for t in ts)
    slope = 0.0 if var == 0 else sum((t - mt) * (r - mr) for t, r in history) / var
    if slope <= 0:
        return current
    return max(current, mr + slope * (ts[-1] + horizon_s - mt))


class Hold:
    """Against flapping: a count goes up at once, and down only once every plan of the
    last `hold_s` seconds wanted it that low (the largest of them is kept meanwhile)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._wants: list[tuple[float, int]] = []

    def apply(self, now_s: float, wanted: int) -> int:
        self._wants.append((now_s, wanted))
        self._wants = [(t, n) for t, n in self._wants if now_s - t <= self.hold_s]
        return max(n for _, n in self._wants)
