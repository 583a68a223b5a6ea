"""Builds the Ray Serve application: router ingress, prefill pool, decode pool.

`build_app(config)` is what `pdserve up` runs; `app_builder(args)` is the entry point a
Serve config file names (`import_path: pdserve.deploy.app:app_builder`, its `args` the
fields of `ClusterConfig`), so `serve run` / `serve deploy` start the same thing.

Several models (`ClusterConfig.models`) are several applications: `app_builder` then
builds the router alone (app `pdserve`, route `/`), and each model's pools are an
application of their own (`pdserve-model-<slug>`, no route) built by
`model_app_builder` from that model's configuration alone. Ray Serve gives an
application one code version, hashed from its import path, runtime_env and args, and
restarts all of its deployments when that changes: so a model added to or removed from
the config restarts the router replicas (whose args list the models; each drains its
streams first) but no other model's pools. `deploy_config` writes that layout as a
Serve config (`serve deploy`'s schema), which `pdserve up` and `pdserve deploy` apply.

A pool of TP > 1 (`prefill_tp`, `decode_tp`) gets a placement group per replica: one
bundle per rank (`ClusterConfig.rank_bundle`), the Serve replica itself in bundle 0 as
rank 0, the other ranks started by its engine in bundles 1.. (runtime/tp_ranks.py), all
on one node (STRICT_PACK). A pool of TP 1 asks for no placement group.
"""

from __future__ import annotations

import os
from typing import Any, cast

from ray.serve import Application, Deployment

from pdserve.cluster.config import ClusterConfig, ConfigError, PoolAutoscaling, model_app_name
from pdserve.cluster.scheduling import replica_ask, router_ask
from pdserve.decode_worker.deployment import DecodeServer
from pdserve.deploy.serve_env import SERVE_ENV, apply_serve_env
from pdserve.prefill_worker.deployment import PrefillServer
from pdserve.router.app import Router
from pdserve.router.models import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT

APP_NAME = "pdserve"
__all__ = [
    "APP_NAME",
    "SERVE_ENV",
    "app_builder",
    "apply_serve_env",
    "build_app",
    "build_model_app",
    "build_router_app",
    "deploy_config",
    "model_app_builder",
]
ROUTER_IMPORT_PATH = "pdserve.deploy.app:app_builder"
MODEL_IMPORT_PATH = "pdserve.deploy.app:model_app_builder"
# Several models: how long a router replica being replaced (a redeploy that adds or
# removes a model) keeps running for the streams it holds. Serve stops sending it new
# requests at once and ends it as soon as it holds none.
ROUTER_DRAIN_S = 300.0
# How often a stopping replica checks for requests still running (Serve's default: 2 s,
# which an idle replica sleeps out once before stopping, and a worker replica once more
# for its last channel call): a scale-down or a stop frees each replica that much sooner.
SHUTDOWN_POLL_S = 0.25
_TARGETED = {"request_router_class": "pdserve.router.request_router:TargetedRequestRouter"}


def router_shutdown_timeout_s(cfg: ClusterConfig) -> float:
    """Serve's backstop for a stopping router replica: it ends its streams itself at
    `shutdown_grace_s` (router/draining.py); this leaves it time to send their error
    events and close its channels before Serve kills it."""
    return cfg.shutdown_grace_s + 5.0


# A worker replica that autoscaling removes finishes its streams for this long at least.
POOL_DRAIN_S = 30.0


def pool_shutdown_timeout_s(cfg: ClusterConfig) -> float:
    """Serve's wait for a stopping worker replica: a scale-down lets its streams finish
    (POOL_DRAIN_S), or moves them elsewhere past `drain_deadline_s` (cluster/drain.py);
    when the cluster stops, its channels end as the routers' streams do (their grace,
    then the error events), and it then leaves the index and stops its engine
    (runtime/replica.py `shutdown`)."""
    return max(POOL_DRAIN_S, cfg.shutdown_grace_s + 10.0, cfg.drain_deadline_s + 10.0)


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


def _runtime_env() -> dict[str, Any]:
    """The replicas get SERVE_ENV wherever they run (a cluster joined with --address, or
    `serve deploy`); the HTTP proxy reads it from the nodes' own environment. Where this
    process has it already (`pdserve up`'s local cluster, the Docker image), so do the
    workers: no runtime_env then, which would start every replica in a fresh worker."""
    env_set = all(os.environ.get(name) == value for name, value in SERVE_ENV.items())
    return {} if env_set else {"env_vars": dict(SERVE_ENV)}


def build_app(config: ClusterConfig) -> Application:
    cfg = config.resolved()
    args = cfg.model_dump(mode="json")
    runtime_env = _runtime_env()
    prefill_app, decode_app = _pools(cfg, args, runtime_env)
    return _router(cfg, runtime_env).bind(args, prefill_app, decode_app)


def _router(cfg: ClusterConfig, runtime_env: dict[str, Any], **options: Any) -> Deployment:
    router_actor = {**router_ask(cfg, APP_NAME).actor_options(), "runtime_env": runtime_env}
    options.setdefault("graceful_shutdown_timeout_s", router_shutdown_timeout_s(cfg))
    options.setdefault("graceful_shutdown_wait_loop_s", SHUTDOWN_POLL_S)
    return cast(Deployment, Router).options(
        num_replicas=cfg.router_replicas,
        ray_actor_options=router_actor,
        max_ongoing_requests=4096,
        **options,
    )


def _pools(
    cfg: ClusterConfig, args: dict[str, Any], runtime_env: dict[str, Any], root: bool = False
) -> tuple[Application | None, Application]:
    """(the prefill pool or None, the decode pool) of one model. `root`: the decode pool
    is its application's root, bound with the prefill pool's handle (which it ignores)
    so that Serve deploys that pool too."""
    from ray import serve

    app = model_app_name(cfg.model_id) if root else APP_NAME

    def worker_options(role: str) -> dict[str, Any]:
        # Serve places a TP replica (rank 0) in bundle 0 of its placement group, which
        # holds everything the actor asks for: the same CPUs, GPUs and custom resources.
        ask = replica_ask(cfg, role, app)
        return {
            "ray_actor_options": {**ask.actor_options(), "runtime_env": runtime_env},
            **ask.group_options(),
            "request_router_config": _TARGETED,
            # The engine batches internally: many concurrent requests per replica.
            "max_ongoing_requests": max(cfg.max_num_seqs, 16),
            "health_check_period_s": 5.0,
            "graceful_shutdown_timeout_s": pool_shutdown_timeout_s(cfg),
            "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
        }

    decode = cast(Deployment, serve.deployment(DecodeServer)).options(
        name=DECODE_DEPLOYMENT,
        **_replicas("decode", cfg.decode_replicas, cfg.decode_autoscaling),
        **worker_options("decode"),
    )
    prefill_app = None
    if cfg.mode == "disagg":
        prefill = cast(Deployment, serve.deployment(PrefillServer)).options(
            name=PREFILL_DEPLOYMENT,
            **_replicas("prefill", cfg.prefill_replicas, cfg.prefill_autoscaling),
            **worker_options("prefill"),
        )
        prefill_app = prefill.bind(args)
    extra = [prefill_app] if root and prefill_app is not None else []  # see `root`
    return prefill_app, decode.bind(args, *extra)


def build_model_app(config: ClusterConfig) -> Application:
    """One model's pools as an application of their own (several models): the decode
    pool is its root, holding the prefill pool's handle so that Serve deploys both."""
    (cfg,) = config.resolved().model_configs()
    _, decode_app = _pools(cfg, cfg.model_dump(mode="json"), _runtime_env(), root=True)
    return decode_app


def build_router_app(config: ClusterConfig) -> Application:
    """The router of several models, alone: it finds each model's pools by name."""
    cfg = config.resolved()
    # Replaced (a model added or removed): new replicas start first and the old ones
    # serve until those are ready, then drain their streams.
    router = _router(
        cfg, _runtime_env(), graceful_shutdown_timeout_s=ROUTER_DRAIN_S, max_surge_percent=100
    )
    return router.bind(cfg.model_dump(mode="json"), None, None)


def app_builder(args: dict[str, Any]) -> Application:
    """Entry point for Serve config files (`serve run config.yaml`).

    Validates the whole configuration first (`ClusterConfig.preflight`), so a bad field
    fails the deploy at once, naming it, rather than replicas failing one by one. Redis
    is not pinged here: Serve may build the app before Redis is up, and the workers wait
    for it. `${NAME}` in `redis_url` / `cluster_token` and `$PDSERVE_API_KEYS` come from
    the environment (`ClusterConfig.from_serve_args`).
    """
    config = ClusterConfig.from_serve_args(args)
    if config.models:  # several models: the router; each model is an app of its own
        return build_router_app(config.preflight())
    return build_app(config.preflight())


def model_app_builder(args: dict[str, Any]) -> Application:
    """Entry point of one model's application when a cluster serves several.

    `args`: that model's configuration, either plain (`model: ...`) or the cluster's
    with a `models` list of exactly this one model (a Serve config can then share the
    cluster's fields and the model's entry with the router's app through YAML anchors).
    Validated as `app_builder` validates.
    """
    config = ClusterConfig.from_serve_args(args)
    if len(config.models) > 1:
        raise ConfigError(
            "models",
            f"a model application serves one model, got {len(config.models)} "
            f"({', '.join(config.model_ids())}); give each its own application",
        )
    (single,) = config.model_configs()
    return build_model_app(single.preflight())


def deploy_config(config: ClusterConfig, host: str, port: int) -> dict[str, Any]:
    """The Serve config (`serve deploy`'s schema, as a dict) of a cluster serving several
    models: the router app `pdserve` on `/` and one app per model (module docstring).

    Each app's args hold the resolved configuration, secrets included (cluster token,
    Redis password, API keys): the Serve controller keeps them as it keeps any app's.
    """
    cfg = config.resolved()
    logging = {"log_level": "WARNING", "enable_access_log": False}
    apps: list[dict[str, Any]] = [
        {
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": ROUTER_IMPORT_PATH,
            "args": cfg.model_dump(mode="json"),
            "logging_config": logging,
        }
    ]
    for single in cfg.model_configs():
        apps.append(
            {
                "name": model_app_name(single.model_id),
                "route_prefix": None,
                "import_path": MODEL_IMPORT_PATH,
                "args": single.model_dump(mode="json"),
                "logging_config": logging,
                "external_scaler_enabled": single.scaled_externally,
            }
        )
    return {"http_options": {"host": host, "port": port}, "applications": apps}
