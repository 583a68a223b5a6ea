"""Shedding by priority: which limits a request of a given priority sees.

A request's priority is its own `priority` field, else its API key's default, else 0.
LARGER is MORE important (the opposite of vLLM, where a smaller number goes first). The
workers serve the waiting queue by priority, then arrival, and preempt the least
important sequence first (engine/sched/scheduler.py); this module is the router's side.

The router sheds in two places: past `max_inflight_requests` admitted requests per
router replica, and when every place that could prefill the prompt has more than
`max_prefill_queue_s` of work queued (disagg.py). Both bounds are scaled by
`limit_fraction`: a request of priority >= `priority_reserved_min` sees the whole
bound, a lower one `1 - priority_headroom` of it. The threshold never decreases with the
priority, so at any load a request is shed only if every less important one would be
too: an important request is never shed while a less important one is admitted, and the
headroom is what the important traffic alone may use once the rest is shed. With the
default headroom 0 every priority sees the same limits (the behaviour before
priorities). Every shed request is counted by its priority and why
(`pdserve_router_shed_requests_total{priority, reason}`). Plain Python.
"""

from __future__ import annotations

import math

from pdserve.cluster.config import ClusterConfig

__all__ = ["SHED_REASONS", "inflight_limit", "limit_fraction", "prefill_queue_bound_s"]

# why a request was shed: this router replica's in-flight bound, or the prefill queues
SHED_REASONS = ("inflight", "prefill_queue")


def limit_fraction(config: ClusterConfig, priority: int) -> float:
    """The fraction of the router's bounds a request of `priority` may fill."""
    if priority >= config.priority_reserved_min:
        return 1.0
    return 1.0 - config.priority_headroom


def inflight_limit(config: ClusterConfig, priority: int) -> int:
    """Admitted requests (this router replica) past which one of `priority` is shed.

    At least 1: however large the headroom, every priority can be served when idle.
    """
    limit = config.max_inflight_requests * limit_fraction(config, priority)
    return max(1, math.floor(limit + 1e-9))  # 40 x 0.7 is 27.999...


def prefill_queue_bound_s(config: ClusterConfig, priority: int) -> float:
    """Seconds of queued prefill work (on every option) past which one is shed."""
    return config.max_prefill_queue_s * limit_fraction(config, priority)
