"""The planner at work: every router observes, one of them decides, Serve applies.

With SLO targets set (`slo_ttft_ms`, `slo_itl_ms`), every `planner.interval_s` each router
replica publishes what it has served (`TrafficCounts`, cumulative) to Redis, and the one
holding the planner's lease (a key renewed each interval; another takes it over within
two intervals when its holder goes) reads every router's counts, turns the window's
differences into the traffic (rate, prompt and output lengths, prefix hits, the share of
prompts decode workers prefilled), reads each pool's measured step cost from the live
workers' heartbeats, and plans (router/planner.py). The counts, held against flapping
(`planner.hold_s`), go to Serve through its external scaling API (router/scaler.py); a
scale-down drains (cluster/drain.py).

Each decision is a log line with its inputs and every candidate's prediction, metrics
(`pdserve_planner_*`), and the planner's state in Redis, which `/workers` shows.

Redis keys, prefixed ``pdserve:{model_id}:planner:``: ``traffic:{router_id}`` HASH its
counts and publish time, expiring after three intervals; ``routers`` SET the router ids
that published; ``leader`` STRING the lease holder's id; ``state`` STRING the last
decision (JSON).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.prefix_index import WorkerInfo
from pdserve.router.planner import (
    Bounds,
    Defaults,
    Plan,
    StepCost,
    Targets,
    Traffic,
    forecast_rate,
    plan,
)
from pdserve.router.planner import Hold as HoldDown

logger = logging.getLogger(__name__)

HISTORY = 6  # windows the rate forecast looks back over
Scale = Callable[[str, int], Awaitable[None]]  # (pool, replicas)


@dataclass
class TrafficCounts:
    """What one router has served since it started (the planner's input), counted by
    `RouterCore` as requests get their first token and finish."""

    requests: int = 0  # that got their first token
    prompt_tokens: int = 0
    completed: int = 0  # that ended (their output counted)
    output_tokens: int = 0
    local_computed: int = 0  # prompt tokens decode workers prefilled, by the policy
    remote_computed: int = 0  # prompt tokens prefill workers prefilled
    # prompt tokens decode workers prefilled because the prefill pool was busy or failed
    # (conditional disaggregation's spills, resumes): demand on the prefill pool
    spilled_computed: int = 0

    def minus(self, other: TrafficCounts) -> TrafficCounts:
        return TrafficCounts(*(a - b for a, b in zip(_values(self), _values(other), strict=True)))

    def plus(self, other: TrafficCounts) -> TrafficCounts:
        return TrafficCounts(*(a + b for a, b in zip(_values(self), _values(other), strict=True)))


def _values(c: TrafficCounts) -> tuple[int, ...]:
    return tuple(getattr(c, f.name) for f in dataclasses.fields(c))


def traffic_of(window: TrafficCounts, seconds: float, last: Traffic | None) -> Traffic:
    """The traffic of a window of `seconds`; lengths from `last` when it saw no request."""
    rate = window.requests / seconds if seconds > 0 else 0.0
    if window.requests <= 0:
        if last is None:
            return Traffic(0.0, 0.0, 0.0)
        return dataclasses.replace(last, rate=rate)
    computed = window.local_computed + window.remote_computed + window.spilled_computed
    prompt = window.prompt_tokens / window.requests
    return Traffic(
        rate=rate,
        prompt_tokens=prompt,
        output_tokens=(
            window.output_tokens / window.completed
            if window.completed
            else (last.output_tokens if last is not None else 0.0)
        ),
        hit=min(max(1.0 - computed / window.prompt_tokens, 0.0), 1.0)
        if window.prompt_tokens
        else 0.0,
        local=window.local_computed / computed if computed else 0.0,
    )


def step_costs(workers: Sequence[WorkerInfo], role: str) -> list[StepCost]:
    """The measured step costs of a pool's live workers (engine `step_*` gauges)."""
    out = []
    for w in workers:
        load = w.load
        if w.role != role or "step_fixed_us" not in load:
            continue
        per_token = load.get("step_prefill_token_ns", 0) / 1e9
        if per_token <= 0 and load.get("prefill_tokens_per_s", 0) > 0:
            per_token = 1.0 / load["prefill_tokens_per_s"]
        out.append(
            StepCost(
                load["step_fixed_us"] / 1e6,
                load.get("step_row_us", 0) / 1e6,
                load.get("step_context_ps", 0) / 1e12,
                per_token if per_token > 0 else Defaults().step.per_prefill_token,
            )
        )
    return out


class PlannerLoop:
    """One model's planner in one router replica (every replica runs one; the lease
    holder decides).

    Args:
        config: The model's configuration (its SLO targets and `planner` settings).
        counts: This router's `TrafficCounts` (RouterCore's).
        redis: The cluster's Redis.
        router_id: This router replica's id.
        live_workers: The model's live workers, with their heartbeat gauges.
        scale: Sets a pool's replica count (router/scaler.py through the app).
        metrics: The model's metrics (`pdserve_planner_*`), or None.
        clock: Seconds, monotonic within a router (tests drive it).
    """

    def __init__(
        self,
        config: ClusterConfig,
        counts: TrafficCounts,
        redis: aioredis.Redis,
        router_id: str,
        live_workers: Callable[[], Awaitable[list[WorkerInfo]]],
        scale: Scale,
        metrics: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.settings = config.planner
        self.counts = counts
        self.redis = redis
        self.router_id = router_id
        self.live_workers = live_workers
        self.scale = scale
        self.metrics = metrics
        self.clock = clock
        self._prefix = f"pdserve:{config.model_id}:planner:"
        self._seen: dict[str, tuple[float, TrafficCounts]] = {}
        self._history: list[tuple[float, float]] = []
        self._last: Traffic | None = None
        hold_s = self.settings.hold_s
        self._holds = {"prefill": HoldDown(hold_s), "decode": HoldDown(hold_s)}
        self.applied: dict[str, int] = {"decode": config.decode_replicas}
        if config.mode == "disagg":
            self.applied["prefill"] = config.prefill_replicas
        self.state: dict[str, Any] | None = None  # the last decision (leader only)

    async def run(self) -> None:
        """Tick every interval until cancelled; a Redis error skips one tick."""
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.tick()
            except (RedisError, OSError) as exc:
                logger.warning("planner: Redis unreachable (%r); next interval", exc)
            except Exception:  # a planner bug must not end the loop: logged, retried
                logger.exception("planner: tick failed")

    async def tick(self) -> dict[str, Any] | None:
        """Publish this router's counts; as the leader, plan and apply. The decision,
        when this router made one."""
        now = self.clock()
        await self._publish(now)
        if not await self._lead():
            return None
        window, seconds = await self._window(now)
        if seconds <= 0:
            return None
        observed = traffic_of(window, seconds, self._last)
        self._last = observed
        self._history = [*self._history, (now, observed.rate)][-HISTORY:]
        forecast = forecast_rate(self._history, self.settings.horizon_s)
        workers = await self.live_workers()
        decision = self._decide(observed, dataclasses.replace(observed, rate=forecast), workers)
        chosen = self._hold(now, decision)
        await self._apply(chosen)
        self.state = self._record(now, observed, forecast, decision, chosen, workers)
        await self.redis.set(self._prefix + "state", json.dumps(self.state), ex=3600)
        return self.state

    async def _publish(self, now: float) -> None:
        key = self._prefix + "traffic:" + self.router_id
        ttl = max(1, round(3 * self.settings.interval_s))
        fields = {"t": now, **dataclasses.asdict(self.counts)}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping=cast(Any, fields))
            pipe.expire(key, ttl)
            pipe.sadd(self._prefix + "routers", self.router_id)
            await pipe.execute()

    async def _lead(self) -> bool:
        """Take or renew the planner's lease (two intervals long)."""
        key = self._prefix + "leader"
        ttl_ms = max(1000, round(2000 * self.settings.interval_s))
        if await self.redis.set(key, self.router_id, nx=True, px=ttl_ms):
            return True
        holder = await self.redis.get(key)
        holder = holder.decode() if isinstance(holder, bytes) else holder
        if holder == self.router_id:
            await self.redis.pexpire(key, ttl_ms)
            return True
        return False

    async def _window(self, now: float) -> tuple[TrafficCounts, float]:
        """Every router's counts since this leader last read them, summed, and the
        window's length (the longest any router's covers)."""
        routers = await self.redis.smembers(self._prefix + "routers")
        total, seconds = TrafficCounts(), 0.0
        for raw in routers:
            rid = _text(raw)
            fields = await self.redis.hgetall(self._prefix + "traffic:" + rid)
            if not fields:  # expired: that router is gone
                await self.redis.srem(self._prefix + "routers", rid)
                self._seen.pop(rid, None)
                continue
            values = {_text(k): float(v) for k, v in fields.items()}
            t = values.pop("t")
            counts = TrafficCounts(**{k: int(v) for k, v in values.items() if k in _FIELDS})
            before = self._seen.get(rid)
            self._seen[rid] = (t, counts)
            if before is None or t <= before[0]:
                continue  # its first reading: the next window counts from here
            total = total.plus(counts.minus(before[1]))
            seconds = max(seconds, t - before[0])
        return total, seconds

    def _decide(self, observed: Traffic, planned: Traffic, workers: list[WorkerInfo]) -> Plan:
        cfg, s = self.config, self.settings
        default = Defaults().step
        decode_step = StepCost.median_of(step_costs(workers, "decode")) or default
        prefill_step = StepCost.median_of(step_costs(workers, "prefill"))
        kv = [
            w.load.get("kv_blocks_total", 0) * cfg.block_size
            for w in workers
            if w.role == "decode" and w.load.get("kv_blocks_total")
        ]
        return plan(
            planned,
            Targets(
                None if cfg.slo_ttft_ms is None else cfg.slo_ttft_ms / 1000,
                None if cfg.slo_itl_ms is None else cfg.slo_itl_ms / 1000,
                cfg.slo_percentile / 100,
                s.headroom,
            ),
            prefill_step,
            decode_step,
            Bounds(s.prefill_min, s.prefill_max) if cfg.mode == "disagg" else None,
            Bounds(s.decode_min, s.decode_max),
            s.budget,
            float(sorted(kv)[len(kv) // 2]) if kv else None,
        )

    def _hold(self, now: float, decision: Plan) -> dict[str, int]:
        chosen = {"decode": self._holds["decode"].apply(now, decision.decode)}
        if decision.prefill is not None:
            chosen["prefill"] = self._holds["prefill"].apply(now, decision.prefill)
        budget = self.settings.budget
        if budget is not None and sum(chosen.values()) > budget:
            chosen = {"decode": decision.decode}  # the hold must not break the budget
            if decision.prefill is not None:
                chosen["prefill"] = decision.prefill
        return chosen

    async def _apply(self, chosen: dict[str, int]) -> None:
        for pool, n in chosen.items():
            before = self.applied.get(pool)
            if n == before:
                continue
            await self.scale(pool, n)
            self.applied[pool] = n
            if self.metrics is not None:
                direction = "up" if before is None or n > before else "down"
                self.metrics.planner_decisions.labels(pool, direction).inc()

    def _record(
        self,
        now: float,
        observed: Traffic,
        forecast: float,
        decision: Plan,
        chosen: dict[str, int],
        workers: list[WorkerInfo],
    ) -> dict[str, Any]:
        actual = {pool: sum(w.role == pool for w in workers) for pool in chosen}
        picked = {
            pool: next((p for p in decision.candidates[pool] if p.replicas == n), None)
            for pool, n in chosen.items()
        }
        state = {
            "time": round(now, 3),
            "leader": self.router_id,
            "observed": {k: round(v, 4) for k, v in dataclasses.asdict(observed).items()},
            "forecast_rate": round(forecast, 4),
            "planned": {"prefill": decision.prefill, "decode": decision.decode},
            "targets": chosen,
            "actual": actual,
            "budget_cut": decision.budget_cut,
            "candidates": {
                pool: [p.as_json() for p in preds] for pool, preds in decision.candidates.items()
            },
        }
        logger.info("planner decision: %s", json.dumps(state, separators=(",", ":")))
        m = self.metrics
        if m is not None:
            m.planner_rate.labels("observed").set(observed.rate)
            m.planner_rate.labels("forecast").set(forecast)
            for pool, n in chosen.items():
                m.planner_target.labels(pool).set(n)
                m.planner_actual.labels(pool).set(actual[pool])
            d, p = picked.get("decode"), picked.get("prefill")
            ttft = p.ttft_s if p is not None else (d.ttft_s if d is not None else None)
            m.planner_predicted.labels("ttft").set(-1 if ttft is None else ttft)
            itl = d.itl_s if d is not None else None
            m.planner_predicted.labels("itl").set(-1 if itl is None else itl)
        return state


_FIELDS = {f.name for f in dataclasses.fields(TrafficCounts)}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def read_state(redis: aioredis.Redis, model_id: str) -> dict[str, Any] | None:
    """The planner's last decision for `/workers` (None: no planner, or none yet)."""
    raw = await redis.get(f"pdserve:{model_id}:planner:state")
    return None if raw is None else dict(json.loads(raw))
