"""`pdserve up`: a whole cluster on this machine (or on an existing Ray cluster).

Starts, in order: an embedded Redis (unless `--redis-url`), Ray (a local head node, or
joins `--address`), Serve's HTTP proxy on `--host:--port`, and the application (router,
prefill and decode pools). It reports each stage, waits until every worker has joined
the prefix index and a one-token completion succeeds, then prints
`pdserve ready at http://HOST:PORT`. On Ctrl-C or SIGTERM it drains (Serve lets running
requests finish within the replicas' graceful-shutdown timeout) and stops everything it
started, leaving no process behind.

One model is one application, deployed imperatively (`serve.run`). Several models are
deployed from a Serve config (deploy/app.py `deploy_config`, deploy/declarative.py), as
`serve deploy` would: `pdserve deploy CONFIG --address ADDR` can then redeploy the
cluster with models added or removed, touching only what changed. Either way it prints
`pdserve ray address ADDR` (stdout) for such a `pdserve deploy`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from pdserve.cluster.config import ClusterConfig, PoolAutoscaling
from pdserve.deploy.ports import LINGER_WAIT_S, wait_for_ports
from pdserve.deploy.redis_server import EmbeddedRedis, free_port

READY_TIMEOUT_S = 600.0
_POLL_S = 0.25


def _say(message: str) -> None:
    print(f"pdserve: {message}", file=sys.stderr, flush=True)


def _http_json(
    url: str,
    body: dict[str, Any] | None = None,
    timeout_s: float = 10.0,
    api_key: str | None = None,
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _initial(replicas: int, scaling: PoolAutoscaling | None) -> int:
    if scaling is None:
        return replicas
    return min(max(replicas, scaling.min_replicas), scaling.max_replicas)


class StartAborted(RuntimeError):
    """Stopped (Ctrl-C / SIGTERM) before the cluster was ready."""


def wait_until_ready(
    base_url: str,
    config: ClusterConfig,
    timeout_s: float,
    stop: threading.Event | None = None,
) -> None:
    """Poll /health until every replica joined the index, then run one completion.

    Raises:
        TimeoutError: the cluster was not ready within timeout_s.
        StartAborted: `stop` was set meanwhile.
    """
    api_key = config.api_keys[0] if config.api_keys else None
    wants = {}
    for cfg in config.model_configs():
        want = {"decode": _initial(cfg.decode_replicas, cfg.decode_autoscaling)}
        if cfg.mode == "disagg":
            want["prefill"] = _initial(cfg.prefill_replicas, cfg.prefill_autoscaling)
        wants[cfg.model_id] = want
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            raise StartAborted("stopped before the cluster was ready")
        try:
            health = _http_json(f"{base_url}/health", timeout_s=5.0)
            # several models: each model's workers; one: the body's own
            models = health.get("models") or {config.model_configs()[0].model_id: health}
            last = {m: (models.get(m) or {}).get("workers") for m in wants}
            if all(
                all((last[m] or {}).get(role, 0) >= n for role, n in want.items())
                for m, want in wants.items()
            ):
                for model_id in wants:
                    _http_json(
                        f"{base_url}/v1/completions",
                        {"model": model_id, "prompt": "ready", "max_tokens": 1},
                        timeout_s=max(deadline - time.monotonic(), 1.0),
                        api_key=api_key,
                    )
                return
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last = exc
        if stop is not None:
            stop.wait(_POLL_S)
        else:
            time.sleep(_POLL_S)
    raise TimeoutError(f"the cluster was not ready within {timeout_s:g}s (last: {last})")


def run_up(
    config: ClusterConfig,
    host: str,
    port: int,
    address: str | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    stop_event: threading.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
    ingress: str = "proxy",
) -> int:
    """Run the cluster until SIGINT/SIGTERM (or `stop_event`); return an exit code.

    `ingress`: "proxy" (Serve's HTTP proxy on host:port) or "direct" (the router
    replicas serve HTTP on port, port + 1, ...; `serve_env.direct_ingress_env` must be in
    the environment before Ray starts, and the proxy gets a free port of its own).
    """
    import ray
    from ray import serve
    from ray.serve.schema import LoggingConfig

    from pdserve.deploy import declarative
    from pdserve.deploy.app import APP_NAME, apply_serve_env, build_app, deploy_config

    stop = stop_event or threading.Event()

    redis_server: EmbeddedRedis | None = None
    started_ray = False
    try:
        if ingress == "direct" and address is None:
            # Serve gives up a direct-ingress port for good the first time its bind fails
            wait_for_ports(
                host,
                range(port, port + config.router_replicas),
                on_wait=lambda p: _say(
                    f"port {p} is still held by a previous server's closed connections "
                    f"(TIME_WAIT); waiting up to {LINGER_WAIT_S:g}s for the kernel to free it"
                ),
            )
        if config.redis_url == "":
            _say("starting the embedded Redis")
            # A password even on loopback: other users of this machine reach it too.
            redis_server = EmbeddedRedis(password=secrets.token_urlsafe(24)).start()
            config = config.model_copy(update={"redis_url": redis_server.url})
        config = config.resolved()
        replicas = sum(
            cfg.decode_replicas + (cfg.prefill_replicas if cfg.mode == "disagg" else 0)
            for cfg in config.model_configs()
        )
        if address is None:
            _say("starting a local Ray cluster")
            apply_serve_env(os.environ)  # the local cluster's processes inherit it
            needed = int(replicas * config.replica_num_cpus) + 1
            ray.init(
                # "local": a cluster of our own even where an earlier `ray start` left its
                # address in /tmp/ray/ray_current_cluster (ray.init() would join that one,
                # or fail to when it is gone)
                address="local",
                include_dashboard=False,
                num_cpus=max(os.cpu_count() or 1, needed),
                logging_level=logging.WARNING,
            )
            started_ray = True
        else:
            _say(f"joining the Ray cluster at {address}")
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        # where `pdserve deploy CONFIG --address ADDR` reaches this cluster
        print(f"pdserve ray address {ray.get_runtime_context().gcs_address}", flush=True)
        # Ray installs its own SIGTERM handler (which exits at once): ours replaces it.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
        proxy_port = port if ingress == "proxy" else free_port()
        serve.start(http_options={"host": host, "port": proxy_port})
        for cfg in config.model_configs():
            what = f"{cfg.decode_replicas} decode"
            if cfg.mode == "disagg":
                what = f"{cfg.prefill_replicas} prefill + {what}"
            _say(f"deploying {cfg.model_id} ({cfg.mode}, {what} replicas, {cfg.transport})")
        if config.models:  # from a Serve config: redeployable (`pdserve deploy`)
            declarative.apply(deploy_config(config, host, proxy_port))
        else:
            serve.run(
                build_app(config),
                name=APP_NAME,
                route_prefix="/",
                blocking=False,
                logging_config=LoggingConfig(log_level="WARNING", enable_access_log=False),
            )
        url = f"http://{host}:{port}"
        _say("waiting for every worker to join the prefix index")
        wait_until_ready(url, config, ready_timeout_s, stop)
        if ingress == "direct" and config.router_replicas > 1:
            ends = ", ".join(f"http://{host}:{port + i}" for i in range(config.router_replicas))
            _say(f"router endpoints (put a load balancer in front): {ends}")
        print(f"pdserve ready at {url}", flush=True)
        if on_ready is not None:
            on_ready(url)
        while not stop.wait(1.0):
            pass
        _say("shutting down: draining requests")
        return 0
    except StartAborted:
        _say("stopped before the cluster was ready")
        return 130
    except (TimeoutError, RuntimeError, ValueError, OSError) as exc:
        _say(f"error: {exc}")
        return 1
    finally:
        if ray.is_initialized():
            try:
                # Deleting the app first is Serve's graceful path: every replica stops
                # taking requests and finishes those it holds (streams included, within
                # its graceful_shutdown_timeout_s) while the HTTP proxy still runs.
                try:
                    # the router first (it drains its streams while the pools still
                    # run), then any other: several models' apps, and those a
                    # `pdserve deploy` added
                    for name in [APP_NAME, *(set(serve.status().applications) - {APP_NAME})]:
                        serve.delete(name, _blocking=True)
                except Exception as exc:  # never deployed, or Serve already gone
                    _say(f"could not delete the application gracefully ({exc!r}); stopping")
                serve.shutdown()
            finally:
                ray.shutdown()
        if started_ray:
            _say("stopped Ray")
        if redis_server is not None:
            redis_server.stop()
        _say("stopped")
