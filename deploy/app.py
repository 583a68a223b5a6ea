"""Builds the Ray Serve application: router ingress, prefill pool, decode pool.

`build_app(config)` is what `pdserve up` runs; `app_builder(args)` is the entry point a
Serve config file names (`import_path: pdserve.deploy.app:app_builder`, its `args` the
fields of `ClusterConfig`), so `serve run` / `serve deploy` start the same thing.

A pool of TP > 1 (`prefill_tp`, `decode_tp`) gets a placement group per replica: one
bundle per rank (`ClusterConfig.rank_bundle`), the Serve replica itself in bundle 0 as
rank 0, the other ranks started by its engine in bundles 1.. (cluster/tp_ranks.py), all
on one node (STRICT_PACK). A pool of TP 1 asks for no placement group.
"""

from __future__ import annotations

import os
from typing import Any, cast

from ray.serve import Application, Deployment

from pdserve.cluster.config import ClusterConfig, PoolAutoscaling
from pdserve.decode_worker.deployment import DecodeServer
from pdserve.deploy.serve_env import SERVE_ENV, apply_serve_env
from pdserve.prefill_worker.deployment import PrefillServer
from pdserve.router.app import Router

APP_NAME = "pdserve"
__all__ = ["APP_NAME", "SERVE_ENV", "app_builder", "apply_serve_env", "build_app"]
_TARGETED = {"request_router_class": "pdserve.router.request_router:TargetedRequestRouter"}


def _replicas(role: str, initial: int, scaling: PoolAutoscaling | None) -> dict[str, Any]:
    """Deployment options of a pool: a fixed count, or Serve autoscaling on its signal."""
    if scaling is None:
        return {"num_replicas": initial}
    if role == "prefill":
        policy = "pdserve.deploy.autoscaling:PrefillPolicy"
        kwargs: dict[str, float] = {"target_queued_tokens": scaling.target}
    else:
        policy = "pdserve.deploy.autoscaling:DecodePolicy"
        kwargs = {"target_running": scaling.target, "target_kv_usage": scaling.target_kv_usage}
    return {
        "num_replicas": "auto",
        "autoscaling_config": {
            "min_replicas": scaling.min_replicas,
            "max_replicas": scaling.max_replicas,
            "initial_replicas": min(max(initial, scaling.min_replicas), scaling.max_replicas),
            "upscale_delay_s": scaling.upscale_delay_s,
            "downscale_delay_s": scaling.downscale_delay_s,
            "look_back_period_s": scaling.look_back_period_s,
            "metrics_interval_s": scaling.metrics_interval_s,
            "policy": {"policy_function": policy, "policy_kwargs": kwargs},
        },
    }


def build_app(config: ClusterConfig) -> Application:
    from ray import serve

    cfg = config.resolved()
    args = cfg.model_dump(mode="json")
    # The replicas get SERVE_ENV wherever they run (a cluster joined with --address, or
    # `serve deploy`); the HTTP proxy reads it from the nodes' own environment. Where this
    # process has it already (`pdserve up`'s local cluster, the Docker image), so do the
    # workers: no runtime_env then, which would start every replica in a fresh worker.
    env_set = all(os.environ.get(name) == value for name, value in SERVE_ENV.items())
    runtime_env: dict[str, Any] = {} if env_set else {"env_vars": dict(SERVE_ENV)}

    def worker_options(role: str) -> dict[str, Any]:
        actor: dict[str, Any] = {
            "num_cpus": cfg.replica_num_cpus,
            "num_gpus": cfg.replica_num_gpus,
            "runtime_env": runtime_env,
        }
        resources = cfg.pool_resources(role)
        if resources:  # a node pool: only nodes started with these custom resources
            actor["resources"] = resources
        tp = cfg.tp(role)
        group: dict[str, Any] = {}
        if tp > 1:
            # Serve places the replica (rank 0) in bundle 0, which must hold everything
            # `actor` asks for: it is the same CPUs, GPUs and custom resources.
            group = {
                "placement_group_bundles": [cfg.rank_bundle(role) for _ in range(tp)],
                "placement_group_strategy": "STRICT_PACK",  # all ranks on one node
            }
        return {
            "ray_actor_options": actor,
            **group,
            "request_router_config": _TARGETED,
            # The engine batches internally: many concurrent requests per replica.
            "max_ongoing_requests": max(cfg.max_num_seqs, 16),
            "health_check_period_s": 5.0,
            "graceful_shutdown_timeout_s": 30.0,
        }

    decode = cast(Deployment, serve.deployment(DecodeServer)).options(
        name="Decode",
        **_replicas("decode", cfg.decode_replicas, cfg.decode_autoscaling),
        **worker_options("decode"),
    )
    prefill_app = None
    if cfg.mode == "disagg":
        prefill = cast(Deployment, serve.deployment(PrefillServer)).options(
            name="Prefill",
            **_replicas("prefill", cfg.prefill_replicas, cfg.prefill_autoscaling),
            **worker_options("prefill"),
        )
        prefill_app = prefill.bind(args)
    router_actor: dict[str, Any] = {"num_cpus": 0, "runtime_env": runtime_env}
    if cfg.router_resources:
        router_actor["resources"] = dict(cfg.router_resources)
    router = cast(Deployment, Router).options(
        num_replicas=cfg.router_replicas,
        ray_actor_options=router_actor,
        max_ongoing_requests=4096,
    )
    return router.bind(args, prefill_app, decode.bind(args))


def app_builder(args: dict[str, Any]) -> Application:
    """Entry point for Serve config files (`serve run config.yaml`).

    Validates the whole configuration first (`ClusterConfig.preflight`), so a bad field
    fails the deploy at once, naming it, rather than replicas failing one by one. Redis
    is not pinged here: Serve may build the app before Redis is up, and the workers wait
    for it. `${NAME}` in `redis_url` / `cluster_token` and `$PDSERVE_API_KEYS` come from
    the environment (`ClusterConfig.from_serve_args`).
    """
    config = ClusterConfig.from_serve_args(args)
    return build_app(config.preflight())
