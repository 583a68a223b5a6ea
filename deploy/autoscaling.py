"""Autoscaling policies of the two pools, each on its own signal (Ray Serve custom policy).

Ray Serve calls a policy every control-loop period with an `AutoscalingContext` whose
`aggregated_metrics` hold what each replica's `record_autoscaling_stats()` reported,
averaged over `look_back_period_s`. A policy returns the replica count it wants; Serve
then applies min/max replicas and the up/down delays of the deployment's
`autoscaling_config` (`ray.serve.autoscaling_policy._apply_autoscaling_config`).

- Prefill scales on queued prefill tokens: the prompt tokens its replicas have not yet
  computed, which is what a new prompt waits behind (its TTFT).
- Decode scales on running sequences and KV-block usage: what bounds its batch and so
  its TPOT and whether new sequences fit.

Plain Python (runs in Serve's controller): no torch. Scale-down is safe by construction:
Serve stops routing to a replica it removes and waits up to
`graceful_shutdown_timeout_s` for its running requests (streams included) before the
replica's shutdown hook leaves the prefix index.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ray.serve.config import AutoscalingContext


def _total(metrics: Mapping[str, Mapping[Any, float]] | None, name: str) -> float | None:
    values = (metrics or {}).get(name)
    return None if not values else float(sum(values.values()))


class PrefillPolicy:
    """Replicas = total queued prefill tokens / target tokens per replica (rounded up).

    Args:
        target_queued_tokens: Queued prompt tokens one replica should hold on average.
    """

    def __init__(self, target_queued_tokens: float = 2048.0) -> None:
        if target_queued_tokens <= 0:
            raise ValueError("target_queued_tokens must be > 0")
        self.target = target_queued_tokens

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        queued = _total(ctx.aggregated_metrics, "queued_prefill_tokens")
        if queued is None:  # no report yet: hold
            return ctx.target_num_replicas, ctx.policy_state
        return max(math.ceil(queued / self.target), 1), ctx.policy_state


class DecodePolicy:
    """Replicas = max(running sequences / target per replica, KV blocks in use / target).

    Args:
        target_running: Running plus waiting sequences one replica should hold.
        target_kv_usage: Fraction of a replica's KV blocks in use to aim for.
    """

    def __init__(self, target_running: float = 32.0, target_kv_usage: float = 0.7) -> None:
        if target_running <= 0 or not 0 < target_kv_usage <= 1:
            raise ValueError("target_running must be > 0 and target_kv_usage in (0, 1]")
        self.target_running = target_running
        self.target_kv_usage = target_kv_usage

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics
        running = _total(metrics, "running")
        used = _total(metrics, "kv_blocks_used")
        total = _total(metrics, "kv_blocks_total")
        if running is None or used is None or not total:
            return ctx.target_num_replicas, ctx.policy_state
        per_replica_blocks = total / max(len((metrics or {}).get("kv_blocks_total", {})), 1)
        by_running = math.ceil(running / self.target_running)
        by_kv = math.ceil(used / (self.target_kv_usage * per_replica_blocks))
        return max(by_running, by_kv, 1), ctx.policy_state
