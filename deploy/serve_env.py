"""Ray Serve's own settings for pdserve, kept free of Ray imports.

Serve reads them from the environment when `ray.serve` is first imported in a process
(a handle's transport is fixed then, in the process that builds the app): so they must be
in the environment before that import, which is why this module imports no Ray.
"""

from __future__ import annotations

from collections.abc import MutableMapping

# Settings for a streaming-heavy application. Every token crosses two Serve hops (decode
# replica -> router replica -> HTTP proxy); with Serve's defaults each hop also crosses
# threads (user code and the handle's router each run in a loop of their own thread) and
# streams through Ray's object-ref generators; these keep each hop on one loop
# (docs/measurements.md has the figures; benchmarks/stream_capacity.py measures the path).
SERVE_ENV = {
    # user code on the replica's main event loop (pdserve's never blocks it: the engine
    # steps on its own thread)
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    # a handle's request router on the caller's loop, not a loop of its own
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # handle calls and proxy -> ingress calls as gRPC streams between the processes
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    # request-path log lines buffered (only warnings are logged per request anyway)
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    # Ray runs every worker process at nice 15 by default (its `worker_niceness`), so the
    # engine's threads, the one thing on a serving node that must not wait, rank below
    # the raylet, GCS, log monitor and any client on the host: each of their wake-ups
    # preempts one of the engine's OpenMP threads and stalls the whole parallel region
    # (docs/measurements.md). The core worker reads it from its own environment at start.
    "RAY_worker_niceness": "0",
}


def apply_serve_env(environ: MutableMapping[str, str]) -> None:
    """Put SERVE_ENV into `environ` (e.g. os.environ before a local `ray.init`), keeping
    any value the operator set."""
    for name, value in SERVE_ENV.items():
        environ.setdefault(name, value)


def direct_ingress_env(port: int, router_replicas: int, drain_s: float) -> dict[str, str]:
    """Serve's direct ingress: each router replica serves HTTP itself, on `port` and up.

    Through Serve's HTTP proxy a request crosses one more process: the proxy takes the
    connection, calls the router replica, and the replica calls back into the proxy for
    the request body; every streamed chunk goes router -> proxy -> client. Under a burst
    of 64 requests the proxy hop alone held responses' headers back 300-400 ms (tiny
    model, 2 cores). With direct ingress the router replicas are the HTTP endpoints (a
    load balancer in front spreads clients over them): the first takes `port`, the next
    `port + 1`, and so on; exactly `router_replicas` ports, so a port that is taken fails
    the replica's start instead of moving it elsewhere, and a replaced replica gets the
    same port back (no quarantine). A stopping router replica keeps serving for
    `drain_s` so that a load balancer can take it out first. Serve reads these settings
    when it is imported (the controller and every replica); the proxy still runs, on the
    head node only, on a port of its own.
    """
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        # exclusive: ports [port, port + router_replicas)
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + router_replicas),
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": f"{drain_s:g}",
    }
