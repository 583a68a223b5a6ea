"""Which replicas Ray cannot place, what one of them asks for, and what the cluster has.

A replica whose resources no node has free waits in Ray's scheduler without an error:
Serve's controller only logs, every 30 s, that it "has taken more than 30s to be
scheduled". `pdserve up` and the router's `/health` name it instead: the deployment, what
one replica asks for (CPUs, GPUs, custom resources, a tensor-parallel replica's
placement-group bundles) and what the cluster has free, or that an autoscaling cluster is
waiting for nodes.

`replica_ask` is also what `deploy/app.py` gives Serve, so the report states exactly what
was asked. The cluster is read from Ray's GCS (the actor table, the nodes' free resources,
the autoscaler's state), which works without the Ray dashboard. Plain Python, no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

from pdserve.cluster.config import ClusterConfig, model_app_name

# A replica actor still waiting for a node that can hold it. Ray reports an actor being
# constructed (a model loading) as PENDING_CREATION too; that one has a worker process
# (a pid), and is not counted.
_WAITING_STATES = ("DEPENDENCIES_UNREADY", "PENDING_CREATION")
REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"  # Serve's replica actor names: PREFIX app#deployment#id
# How long a replica may wait for resources before it is reported: long enough that the
# ordinary start of a replica (Ray starting its worker process) never is.
UNSCHEDULED_AFTER_S = 10.0


@dataclasses.dataclass(frozen=True)
class ReplicaAsk:
    """What one replica of a deployment asks Ray for.

    `bundles`: a tensor-parallel replica's placement group, one bundle per rank (all on
    one node: STRICT_PACK); the replica itself runs in bundle 0. Empty without TP.
    """

    app: str
    deployment: str
    num_cpus: float
    num_gpus: float
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)
    bundles: tuple[Mapping[str, float], ...] = ()
    strategy: str = "STRICT_PACK"

    def actor_options(self) -> dict[str, Any]:
        """Serve's `ray_actor_options` resource fields for this ask."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        return options

    def group_options(self) -> dict[str, Any]:
        """Serve's placement-group deployment options (none without TP)."""
        if not self.bundles:
            return {}
        return {
            "placement_group_bundles": [dict(b) for b in self.bundles],
            "placement_group_strategy": self.strategy,
        }

    def per_node(self) -> dict[str, float]:
        """What one node must have free for one replica (all bundles: STRICT_PACK)."""
        if self.bundles:
            total: dict[str, float] = {}
            for bundle in self.bundles:
                for name, amount in bundle.items():
                    total[name] = total.get(name, 0.0) + amount
            return total
        single = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {name: float(amount) for name, amount in single.items() if amount > 0}

    def describe(self) -> str:
        if self.bundles:
            each = _resources_text(self.bundles[0])
            same = all(dict(b) == dict(self.bundles[0]) for b in self.bundles)
            kinds = f"{{{each}}} each" if same else "; ".join(map(_resources_text, self.bundles))
            return (
                f"a placement group of {len(self.bundles)} bundles ({kinds}) on one node "
                f"({self.strategy}): {_resources_text(self.per_node())} in all"
            )
        return _resources_text(self.per_node()) or "no resources"

    def fits(self, free_per_node: Iterable[Mapping[str, float]]) -> bool:
        """Whether some node has what one replica needs free now."""
        need = self.per_node()
        return any(
            all(free.get(name, 0.0) + 1e-9 >= amount for name, amount in need.items())
            for free in free_per_node
        )


def _resources_text(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {amount:g}" for name, amount in sorted(resources.items()))


def replica_ask(cfg: ClusterConfig, role: str, app: str) -> ReplicaAsk:
    """What one replica of `cfg`'s `role` pool ("prefill" | "decode") asks for."""
    name = "Prefill" if role == "prefill" else "Decode"
    tp = cfg.tp(role)
    bundles = tuple(cfg.rank_bundle(role) for _ in range(tp)) if tp > 1 else ()
    return ReplicaAsk(
        app=app,
        deployment=name,
        num_cpus=cfg.replica_num_cpus,
        num_gpus=cfg.replica_num_gpus,
        resources=cfg.pool_resources(role),
        bundles=bundles,
    )


def router_ask(cfg: ClusterConfig, app: str) -> ReplicaAsk:
    return ReplicaAsk(app, "Router", 0.0, 0.0, dict(cfg.router_resources))


def cluster_asks(config: ClusterConfig, router_app: str) -> list[ReplicaAsk]:
    """Every deployment's ask: the router, and each model's pools (their own application
    when the cluster serves several models)."""
    asks = [router_ask(config, router_app)]
    for cfg in config.model_configs():
        app = model_app_name(cfg.model_id) if config.models else router_app
        roles = ("prefill", "decode") if cfg.mode == "disagg" else ("decode",)
        asks += [replica_ask(cfg, role, app) for role in roles]
    return asks


@dataclasses.dataclass(frozen=True)
class Unscheduled:
    """Replicas of one deployment that no node could place for `waiting_s`."""

    ask: ReplicaAsk
    num_waiting: int
    waiting_s: float
    free: Mapping[str, float]  # summed over nodes
    total: Mapping[str, float]
    num_nodes: int
    autoscaling: bool

    def message(self) -> str:
        who = f"{self.ask.deployment} (application {self.ask.app})"
        waiting = (
            f"{self.num_waiting} replica{'s' if self.num_waiting > 1 else ''} of {who} "
            f"cannot be scheduled (waiting {self.waiting_s:.0f} s)"
        )
        have = ", ".join(
            f"{self.free.get(name, 0.0):g} of {self.total.get(name, 0.0):g} {name}"
            for name in sorted(self.ask.per_node())
        )
        nodes = f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''}"
        cluster = f"the cluster has {have or 'nothing'} free ({nodes})"
        if self.autoscaling:
            hint = "the autoscaler is adding nodes: waiting for them"
        else:
            hint = (
                "free them, add a node with them, or ask for less (fewer replicas or "
                "tensor-parallel ranks, --replica-cpus / --replica-gpus)"
            )
        return f"{waiting}: one replica asks for {self.ask.describe()}; {cluster}; {hint}"

    def as_json(self) -> dict[str, Any]:
        return {
            "application": self.ask.app,
            "deployment": self.ask.deployment,
            "waiting_replicas": self.num_waiting,
            "waiting_s": round(self.waiting_s, 1),
            "replica_asks": self.ask.per_node(),
            "placement_group_bundles": [dict(b) for b in self.ask.bundles] or None,
            "cluster_free": {name: self.free.get(name, 0.0) for name in self.ask.per_node()},
            "cluster_total": {name: self.total.get(name, 0.0) for name in self.ask.per_node()},
            "autoscaling": self.autoscaling,
            "message": self.message(),
        }


@dataclasses.dataclass(frozen=True)
class ClusterView:
    """What the scheduler knows now: replica actors still waiting for a node (actor id ->
    (application, deployment)), each node's free and total resources, and whether an
    autoscaler runs."""

    waiting: Mapping[str, tuple[str, str]]
    free_per_node: list[Mapping[str, float]]
    total_per_node: list[Mapping[str, float]]
    autoscaling: bool


def read_cluster(apps: Iterable[str]) -> ClusterView:
    """The view of the Ray cluster this process is connected to (GCS calls; blocking)."""
    from ray._private import state

    wanted = set(apps)
    waiting: dict[str, tuple[str, str]] = {}
    for state_name in _WAITING_STATES:
        for actor_id, info in state.actors(actor_state_name=state_name).items():
            parsed = _replica_of(info.get("Name", ""))
            if parsed is not None and parsed[0] in wanted and not info.get("Pid"):
                waiting[actor_id] = parsed
    free = state.available_resources_per_node()
    total = state.total_resources_per_node()
    return ClusterView(
        waiting=waiting,
        free_per_node=[_public(r) for r in free.values()],
        total_per_node=[_public(r) for r in total.values()],
        autoscaling=_autoscaling(),
    )


def _replica_of(actor_name: str) -> tuple[str, str] | None:
    """(application, deployment) of a Serve replica actor's name, else None."""
    if not actor_name.startswith(REPLICA_ACTOR_PREFIX):
        return None
    parts = actor_name.removeprefix(REPLICA_ACTOR_PREFIX).split("#")
    return (parts[0], parts[1]) if len(parts) == 3 else None


def _public(resources: Mapping[str, float]) -> dict[str, float]:
    """A node's resources without Ray's bookkeeping entries (node:..., memory, bundle
    resources of placement groups)."""
    hidden = ("node:", "memory", "object_store_memory", "accelerator_type:")
    return {
        name: float(amount)
        for name, amount in resources.items()
        if not name.startswith(hidden) and "_group_" not in name
    }


def _autoscaling() -> bool:
    """Whether an autoscaler may add the nodes (KubeRay's, `ray up`'s). Its state is in
    the GCS's KV store: the node groups it may launch (autoscaler v2), or, from the v1
    monitor, nodes being launched (every cluster runs that monitor; on one started by
    `ray start` or `ray.init` it only reads the nodes there are)."""
    from ray._private import ray_constants, state

    with contextlib.suppress(Exception):
        config = state.state.get_cluster_config()
        if config is not None and len(config.node_group_configs) > 0:
            return True
    with contextlib.suppress(Exception):
        from ray.experimental.internal_kv import _internal_kv_get

        status = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        report = json.loads(status or b"{}").get("autoscaler_report") or {}
        return bool(report.get("pending_launches") or report.get("pending_nodes"))
    return False


class SchedulingWatch:
    """Replicas that have waited for a node longer than `after_s`, per deployment.

    `check(view)` is called every poll with a fresh `ClusterView`; it remembers when each
    waiting replica was first seen. A replica that some node could hold now is not
    reported (it is being placed, not refused).
    """

    def __init__(self, asks: Iterable[ReplicaAsk], after_s: float = UNSCHEDULED_AFTER_S):
        self.asks = {(a.app, a.deployment): a for a in asks}
        self.after_s = after_s
        self._since: dict[str, float] = {}

    @property
    def apps(self) -> set[str]:
        return {app for app, _ in self.asks}

    def check(self, view: ClusterView, now: float | None = None) -> list[Unscheduled]:
        now = time.monotonic() if now is None else now
        self._since = {a: self._since.get(a, now) for a in view.waiting}
        by_deployment: dict[tuple[str, str], list[float]] = {}
        for actor_id, key in view.waiting.items():
            by_deployment.setdefault(key, []).append(now - self._since[actor_id])
        out = []
        for key, waits in sorted(by_deployment.items()):
            ask = self.asks.get(key)
            if ask is None or max(waits) < self.after_s or ask.fits(view.free_per_node):
                continue
            out.append(
                Unscheduled(
                    ask=ask,
                    num_waiting=len(waits),
                    waiting_s=max(waits),
                    free=_summed(view.free_per_node),
                    total=_summed(view.total_per_node),
                    num_nodes=len(view.total_per_node),
                    autoscaling=view.autoscaling,
                )
            )
        return out


def _summed(per_node: Iterable[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for resources in per_node:
        for name, amount in resources.items():
            total[name] = total.get(name, 0.0) + amount
    return total
