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

import contextlib
import json
import logging
import os
import secrets
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from pdserve.cluster import stop_notice
from pdserve.cluster.config import ClusterConfig, PoolAutoscaling
from pdserve.cluster.scheduling import SchedulingWatch, cluster_asks, read_cluster
from pdserve.common.engine_config import usable_cpus
from pdserve.deploy.ports import LINGER_WAIT_S, wait_for_ports
from pdserve.deploy.redis_server import EmbeddedRedis, free_port
from pdserve.deploy.stopping import StartAborted, StopSignals, stop_budget_s

READY_TIMEOUT_S = 600.0
_POLL_S = 0.25
# The ready check's one-token completion: a stop must not wait for more than this.
_READY_CALL_S = 30.0
# What a stop keeps for Ray's own shutdown and Redis's, out of its budget.
_TEARDOWN_RESERVE_S = 6.0
# How long after the streams' grace the routers may take to end them and say so.
_DRAIN_MARGIN_S = 3.0


def say(message: str) -> None:
    # one write: lines from the signal thread never run into it
    sys.stderr.write(f"pdserve: {message}\n")
    sys.stderr.flush()


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


def _app_statuses(names: list[str]) -> dict[str, tuple[str, str]]:
    """(status, message) of each named Serve application that exists."""
    from ray import serve

    apps = serve.status().applications
    return {
        name: (str(getattr(apps[name].status, "value", apps[name].status)), apps[name].message)
        for name in names
        if name in apps
    }


class _Starting:
    """What `wait_until_ready` watches besides /health: a failed deploy, and replicas
    that Ray cannot place (cluster/scheduling.py), each reported once, then again
    every REPORT_AGAIN_S while it lasts."""

    REPORT_AGAIN_S = 60.0
    CHECK_S = 1.0  # Serve's status and Ray's GCS asked at most this often

    def __init__(self, config: ClusterConfig, apps: list[str]) -> None:
        from pdserve.deploy.app import APP_NAME

        self.apps = apps
        self.watch = SchedulingWatch(cluster_asks(config, APP_NAME))
        self._reported: dict[str, float] = {}
        self._checked_s = -self.CHECK_S

    def check(self) -> None:
        """Raises RuntimeError: an application failed to deploy."""
        if time.monotonic() - self._checked_s < self.CHECK_S:
            return
        self._checked_s = time.monotonic()
        for name, (status, message) in _app_statuses(self.apps).items():
            if status == "DEPLOY_FAILED":
                raise RuntimeError(f"application {name} failed to deploy: {message}")
        now = time.monotonic()
        for report in self.watch.check(read_cluster(self.watch.apps), now):
            key = f"{report.ask.app}/{report.ask.deployment}/{report.num_waiting}"
            if now - self._reported.get(key, -self.REPORT_AGAIN_S) >= self.REPORT_AGAIN_S:
                self._reported[key] = now
                say(report.message())


def wait_until_ready(
    base_url: str,
    config: ClusterConfig,
    timeout_s: float,
    stop: threading.Event | None = None,
    starting: _Starting | None = None,
) -> None:
    """Poll /health until every replica joined the index, then run one completion.

    `starting`: also fail at once when an application fails to deploy, and name the
    replicas Ray cannot place.

    Raises:
        TimeoutError: the cluster was not ready within timeout_s.
        StartAborted: `stop` was set meanwhile.
        RuntimeError: an application failed to deploy.
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
        if starting is not None:
            starting.check()
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
                        timeout_s=min(max(deadline - time.monotonic(), 1.0), _READY_CALL_S),
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
    signals: StopSignals | None = None,
) -> int:
    """Run the cluster until SIGINT/SIGTERM (or `stop_event`); return an exit code.

    `ingress`: "proxy" (Serve's HTTP proxy on host:port) or "direct" (the router
    replicas serve HTTP on port, port + 1, ...; `serve_env.direct_ingress_env` must be in
    the environment before Ray starts, and the proxy gets a free port of its own).
    `signals`: the CLI's signal handling (deploy/stopping.py), whose `stop` ends the run;
    without it, `stop_event` does (a cluster run on a thread of another program).
    """
    import ray
    from ray.serve.schema import LoggingConfig

    from pdserve.deploy import declarative
    from pdserve.deploy.app import APP_NAME, apply_serve_env, build_app, deploy_config

    stop = signals.stop if signals is not None else (stop_event or threading.Event())
    interruptible = signals.interruptible if signals is not None else contextlib.nullcontext

    redis_server: EmbeddedRedis | None = None
    started_ray = False
    try:
        if ingress == "direct" and address is None:
            # Serve gives up a direct-ingress port for good the first time its bind fails
            wait_for_ports(
                host,
                range(port, port + config.router_replicas),
                on_wait=lambda p: say(
                    f"port {p} is still held by a previous server's closed connections "
                    f"(TIME_WAIT); waiting up to {LINGER_WAIT_S:g}s for the kernel to free it"
                ),
                stop=stop,
            )
        if config.redis_url == "":
            say("starting the embedded Redis")
            # A password even on loopback: other users of this machine reach it too.
            with interruptible():
                redis_server = EmbeddedRedis(
                    password=secrets.token_urlsafe(24), die_with_parent=True
                ).start()
            config = config.model_copy(update={"redis_url": redis_server.url})
        config = config.resolved()
        if address is None:
            config = with_local_threads(config)
        with interruptible():
            started_ray = _start_ray(config, address, apply_serve_env)
        if signals is not None:
            signals.reinstall()  # Ray's driver installs a SIGTERM handler that exits at once
        # where `pdserve deploy CONFIG --address ADDR` reaches this cluster
        print(f"pdserve ray address {ray.get_runtime_context().gcs_address}", flush=True)
        if stop.is_set():
            raise StartAborted("stopped before the cluster was ready")
        proxy_port = port if ingress == "proxy" else free_port()
        for cfg in config.model_configs():
            what = f"{cfg.decode_replicas} decode"
            if cfg.mode == "disagg":
                what = f"{cfg.prefill_replicas} prefill + {what}"
            say(f"deploying {cfg.model_id} ({cfg.mode}, {what} replicas, {cfg.transport})")
        if config.models:  # from a Serve config: redeployable (`pdserve deploy`)
            apps = declarative.apply(deploy_config(config, host, proxy_port))
        else:
            from ray import serve

            serve.start(http_options={"host": host, "port": proxy_port})
            # Not serve.run: it waits for the application without a bound, deaf to stop.
            serve._run(
                build_app(config),
                _blocking=False,
                name=APP_NAME,
                route_prefix="/",
                logging_config=LoggingConfig(log_level="WARNING", enable_access_log=False),
                external_scaler_enabled=config.scaled_externally,
            )
            apps = [APP_NAME]
        url = f"http://{host}:{port}"
        say("waiting for every worker to join the prefix index")
        wait_until_ready(url, config, ready_timeout_s, stop, _Starting(config, apps))
        if ingress == "direct" and config.router_replicas > 1:
            ends = ", ".join(f"http://{host}:{port + i}" for i in range(config.router_replicas))
            say(f"router endpoints (put a load balancer in front): {ends}")
        print(f"pdserve ready at {url}", flush=True)
        if on_ready is not None:
            on_ready(url)
        while not stop.wait(1.0):
            pass
        say(
            f"shutting down: running streams may go on for {config.shutdown_grace_s:g} s, "
            "new requests get 503"
        )
        return 0
    except StartAborted:
        say("stopped before the cluster was ready")
        return 130
    except (TimeoutError, RuntimeError, ValueError, OSError) as exc:
        say(f"error: {exc}")
        return 1
    finally:
        deadline_s = signals.deadline_s if signals is not None else None
        if deadline_s is None:  # no signal: an error, or `stop_event`
            deadline_s = time.monotonic() + stop_budget_s(config.shutdown_grace_s)
        if ray.is_initialized():
            try:
                _stop_serve(config, deadline_s - _TEARDOWN_RESERVE_S, joined=not started_ray)
            except Exception as exc:  # never deployed, or Serve already gone
                say(f"could not stop the applications gracefully ({exc!r}); stopping Ray")
            finally:
                ray.shutdown()
        if started_ray:
            say("stopped Ray")
        if redis_server is not None:
            redis_server.stop()
        say("stopped")


def engine_processes(config: ClusterConfig) -> int:
    """The engine processes a cluster of `config` runs at most: every replica of every
    pool (its autoscaling maximum, when it scales), times its tensor-parallel ranks."""
    total = 0
    for cfg in config.model_configs():
        pools = [("decode", cfg.decode_replicas, cfg.decode_autoscaling)]
        if cfg.mode == "disagg":
            pools.append(("prefill", cfg.prefill_replicas, cfg.prefill_autoscaling))
        for role, replicas, scaling in pools:
            most = max(replicas, scaling.max_replicas if scaling is not None else 0)
            total += most * cfg.tp(role)
    return total


def with_local_threads(config: ClusterConfig) -> ClusterConfig:
    """On a cluster of its own, `pdserve up` knows every engine process the machine will
    run: unless threads are chosen (`num_threads`, `OMP_NUM_THREADS`, or a pool's pinned
    CPUs), the usable CPUs are shared among them, so one replica on a machine of its own
    uses every core, as an offline `LLM` does, rather than its one Ray CPU's thread."""
    chosen = config.num_threads is not None or config.prefill_cpus or config.decode_cpus
    if chosen or os.environ.get("OMP_NUM_THREADS", "").strip():
        return config
    if any(cfg.num_threads is not None for cfg in config.model_configs()):
        return config
    share = usable_cpus() // max(1, engine_processes(config))
    if share <= config.threads("decode"):
        return config
    say(
        f"each engine process uses {share} threads ({usable_cpus()} CPUs, "
        f"{engine_processes(config)} engine processes)"
    )
    return config.model_copy(update={"num_threads": share})


def _start_ray(config: ClusterConfig, address: str | None, apply_env: Callable[..., Any]) -> bool:
    """Start a local Ray cluster (True), or join the one at `address` (False)."""
    import ray

    if address is not None:
        say(f"joining the Ray cluster at {address}")
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        return False
    say("starting a local Ray cluster")
    apply_env(os.environ)  # the local cluster's processes inherit it
    replicas = sum(
        cfg.decode_replicas + (cfg.prefill_replicas if cfg.mode == "disagg" else 0)
        for cfg in config.model_configs()
    )
    needed = int(replicas * config.replica_num_cpus) + 1
    ray.init(
        # "local": a cluster of our own even where an earlier `ray start` left its
        # address in /tmp/ray/ray_current_cluster (ray.init() would join that one, or
        # fail to when it is gone)
        address="local",
        include_dashboard=False,
        num_cpus=max(os.cpu_count() or 1, needed),
        logging_level=logging.WARNING,
    )
    return True


def _stop_serve(config: ClusterConfig, until_s: float, joined: bool) -> None:
    """Stop the applications in order, until `until_s` at most: first the routers drain
    (cluster/stop_notice.py: new requests 503, streams finish or end with an error event
    after `shutdown_grace_s`), then every application is deleted and waited for. On a
    joined cluster, Serve itself is stopped too; a local one goes with Ray."""
    from ray import serve
    from ray.serve.context import _get_global_client

    try:
        routers = stop_notice.announce(
            config.redis_url, config.cluster_token, config.shutdown_grace_s
        )
        drain_until = min(until_s, time.monotonic() + config.shutdown_grace_s + _DRAIN_MARGIN_S)
        drained = stop_notice.wait_drained(
            config.redis_url, config.cluster_token, routers, drain_until
        )
        if drained < routers:
            say(f"{routers - drained} of {routers} routers did not drain in time")
    except (RedisError, OSError) as exc:  # Redis gone: the routers see the deletion
        say(f"could not tell the routers to drain ({exc!r})")
    names = list(serve.status().applications)
    for name in names:
        serve.delete(name, _blocking=False)
    while (left := _app_statuses(names)) and time.monotonic() < until_s:
        time.sleep(_POLL_S)
    if left:
        say(f"applications {sorted(left)} did not stop in time; stopping Ray with them")
    if joined:
        client = _get_global_client()
        if client is not None:
            client.shutdown(timeout_s=max(1.0, until_s - time.monotonic()))
