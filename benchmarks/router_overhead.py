"""What the router path costs: 1-token completions through it against a decode handle.

    python -m pdserve.benchmarks.router_overhead [--mode colocated|disagg] [--requests 200]
        [--warmup 20] [--concurrency 16] [--duration 10] [--json PATH]

Starts a whole cluster in this process (a Redis server, then `deploy.up.run_up` on a
background thread: a local Ray head and the Serve application) on the demo model by default,
then sends, in one run, the same greedy 1-token completion of a fixed 16-token prompt
(token ids, `ignore_eos`) two ways:

- router: `POST /v1/completions` over one keep-alive connection per client, through
  Serve's HTTP proxy, the router replica (validation, the prefix-index lookup in Redis,
  placement) and the decode worker; with `--mode disagg` also the prefill on a prefill
  worker and the KV push to the decode worker;
- direct: `handle.options(stream=True).generate.remote(...)` on the `Decode` deployment
  from this driver, consumed until the item with `finished`: the call the router makes.

It measures (1) sequential latency: `--warmup` untimed requests, then `--requests` timed
ones, one at a time, p50 and p99; and (2) throughput: `--concurrency` clients, each
sending its next request when the last one returns, for `--duration` seconds. It prints
both sides and the ratio router / direct. Clients run in this process on one asyncio loop
(aiohttp for HTTP), so both sides pay for a client's CPU; on a small machine the client,
the proxy, the router and the workers share the same cores, which is part of the cost.
Benchmarks live here, never in tests (STYLE.md, habit 9).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.benchmarks.machine import print_machine
from pdserve.cluster.config import ClusterConfig, Mode
from pdserve.common.sampling_params import SamplingParams
from pdserve.deploy.redis_server import EmbeddedRedis, free_port

HOST = "127.0.0.1"
DECODE_DEPLOYMENT = "Decode"  # the name `deploy/app.py` gives the decode pool
PROMPT_LEN = 16
READY_TIMEOUT_S = 300.0  # cluster start on 2 cores takes ~20 s; a cold Ray can take minutes
STOP_TIMEOUT_S = 120.0  # Serve drains replicas for up to 30 s, then Ray and Redis stop
REQUEST_TIMEOUT_S = 60.0

Complete = Callable[[], Awaitable[list[int]]]  # one 1-token request -> its output token ids


@dataclass(frozen=True)
class Side:
    """One path's figures: sequential latency percentiles and closed-loop throughput."""

    p50_ms: float
    p99_ms: float
    num_timed: int
    requests_per_s: float
    num_load_requests: int


@dataclass(frozen=True)
class Report:
    mode: str
    client: str
    concurrency: int
    duration_s: float
    router: Side
    direct: Side

    def ratios(self) -> dict[str, float]:
        r, d = self.router, self.direct
        return {
            "p50": r.p50_ms / d.p50_ms,
            "p99": r.p99_ms / d.p99_ms,
            "requests_per_s": r.requests_per_s / d.requests_per_s,
        }


# -- the cluster -----------------------------------------------------------------------------


def start_redis(attempts: int = 3) -> EmbeddedRedis:
    """The cluster's Redis, started here rather than by `run_up`, to retry its start.

    NOTE: workaround. `EmbeddedRedis._wait_until_ready` waits on a selector and then calls
    `readline()` on a buffered text pipe: when redis-server writes its "Ready to accept
    connections" line in the same chunk as earlier lines, the line sits in Python's buffer,
    the selector never fires again and start() times out after its STARTUP_TIMEOUT_S
    (1 to 3 starts in 10 on the 2-core dev box). A second try starts a fresh server.
    """
    for attempt in range(1, attempts + 1):
        try:
            return EmbeddedRedis(HOST).start()
        except TimeoutError:
            if attempt == attempts:
                raise
            print("redis-server start timed out; retrying", file=sys.stderr)
    raise AssertionError("unreachable")


@contextlib.contextmanager
def running_cluster(config: ClusterConfig, port: int) -> Iterator[str]:
    """Run `run_up` on a thread until the block ends; yield the cluster's base URL.

    NOTE: `run_up` installs its SIGINT/SIGTERM handlers only on the main thread, so here
    Ctrl-C raises KeyboardInterrupt in the main thread and the `finally` stops the cluster.
    """
    from pdserve.deploy.up import run_up

    stop, ready = threading.Event(), threading.Event()
    urls: list[str] = []
    exit_codes: list[int] = []

    def on_ready(url: str) -> None:
        urls.append(url)
        ready.set()

    redis = start_redis()
    config = config.model_copy(update={"redis_url": redis.url})

    def target() -> None:
        exit_codes.append(run_up(config, HOST, port, None, READY_TIMEOUT_S, stop, on_ready))

    # daemon: should the cluster not stop within STOP_TIMEOUT_S, this process still exits.
    thread = threading.Thread(target=target, name="pdserve-up", daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + READY_TIMEOUT_S + 30.0
        while not ready.wait(0.5):
            if not thread.is_alive():
                raise RuntimeError(f"the cluster failed to start (exit code {exit_codes})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster was not ready within {READY_TIMEOUT_S:g}s")
        yield urls[0]
    finally:
        stop.set()
        if thread.ident is not None:  # started
            thread.join(STOP_TIMEOUT_S)
        if thread.is_alive():
            print(f"warning: the cluster did not stop within {STOP_TIMEOUT_S:g}s", file=sys.stderr)
        redis.stop()


# -- the two paths -----------------------------------------------------------------------------


def router_path(session: Any, url: str, model_id: str, prompt: list[int]) -> Complete:
    body = {
        "model": model_id,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }

    async def complete() -> list[int]:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            payload = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"the router answered {resp.status}: {payload}")
        return list(payload["choices"][0]["token_ids"])

    return complete


def direct_path(handle: Any, prompt: list[int]) -> Complete:
    # The same parameters `to_sampling_params` makes of the router path's request body.
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def complete() -> list[int]:
        request_id = f"direct-{uuid.uuid4().hex}"
        stream = handle.options(stream=True).generate.remote(request_id, prompt, params)
        token_ids: list[int] = []
        async for item in stream:
            if item["type"] == "output":
                token_ids += item["token_ids"]
                if item["finished"]:
                    return token_ids
        raise RuntimeError(f"{request_id}: the decode stream ended before finishing")

    return complete


# -- measurements ------------------------------------------------------------------------------


async def timed(complete: Complete) -> float:
    """Seconds for one request; raises if it fails or exceeds REQUEST_TIMEOUT_S."""
    start = time.perf_counter()
    token_ids = await asyncio.wait_for(complete(), REQUEST_TIMEOUT_S)
    if len(token_ids) != 1:
        raise RuntimeError(f"expected 1 output token, got {token_ids}")
    return time.perf_counter() - start


async def sequential_s(complete: Complete, num_requests: int, num_warmup: int) -> list[float]:
    for _ in range(num_warmup):
        await timed(complete)
    return [await timed(complete) for _ in range(num_requests)]


async def closed_loop(complete: Complete, concurrency: int, duration_s: float) -> tuple[int, float]:
    """(requests completed, seconds) with `concurrency` clients, each one request at a time.

    Every request a client started before the deadline is counted, and the clock stops when
    the last one returns, so nothing in flight is dropped from either side of the ratio.
    """
    deadline = time.perf_counter() + duration_s

    async def client() -> int:
        count = 0
        while time.perf_counter() < deadline:
            await timed(complete)
            count += 1
        return count

    start = time.perf_counter()
    counts = await asyncio.gather(*(client() for _ in range(concurrency)))
    return sum(counts), time.perf_counter() - start


async def measure_side(complete: Complete, args: argparse.Namespace) -> Side:
    latencies_ms = np.array(await sequential_s(complete, args.requests, args.warmup)) * 1e3
    num_done, elapsed_s = await closed_loop(complete, args.concurrency, args.duration)
    return Side(
        p50_ms=float(np.percentile(latencies_ms, 50)),
        p99_ms=float(np.percentile(latencies_ms, 99)),
        num_timed=len(latencies_ms),
        requests_per_s=num_done / elapsed_s,
        num_load_requests=num_done,
    )


async def measure(url: str, config: ClusterConfig, args: argparse.Namespace) -> Report:
    # aiohttp, not httpx: Ray Serve depends on aiohttp, so it is always installed.
    import aiohttp
    from ray import serve

    from pdserve.deploy.app import APP_NAME

    prompt = [5 + i for i in range(PROMPT_LEN)]  # past the 5 special tokens of the demo vocab
    handle = serve.get_deployment_handle(DECODE_DEPLOYMENT, app_name=APP_NAME)
    direct = direct_path(handle, prompt)
    # One connection per concurrent client, kept alive: the HTTP side never pays a handshake.
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        router = router_path(session, url, config.model_id, prompt)
        # Greedy on both paths: the same prompt must give the same token.
        via_router, via_handle = await router(), await direct()
        if via_router != via_handle:
            raise RuntimeError(f"router gave {via_router}, the decode handle {via_handle}")
        router_side = await measure_side(router, args)
        direct_side = await measure_side(direct, args)
    client = f"aiohttp {aiohttp.__version__}"
    return Report(config.mode, client, args.concurrency, args.duration, router_side, direct_side)


# -- reporting ---------------------------------------------------------------------------------


def markdown_table(report: Report) -> str:
    r, d, ratio = report.router, report.direct, report.ratios()
    load = f"requests/s ({report.concurrency} clients, {report.duration_s:g} s)"
    rates = [f"{r.requests_per_s:.1f}", f"{d.requests_per_s:.1f}"]
    rows = [
        ["metric", "router", "direct handle", "router / direct"],
        ["---"] * 4,
        ["p50 latency (ms)", f"{r.p50_ms:.2f}", f"{d.p50_ms:.2f}", f"{ratio['p50']:.2f}"],
        ["p99 latency (ms)", f"{r.p99_ms:.2f}", f"{d.p99_ms:.2f}", f"{ratio['p99']:.2f}"],
        [load, *rates, f"{ratio['requests_per_s']:.2f}"],
    ]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in rows)


def summary(report: Report) -> str:
    r, d, ratio = report.router, report.direct, report.ratios()
    return (
        f"{report.mode}: the router path adds {r.p50_ms - d.p50_ms:.2f} ms at p50 "
        f"({ratio['p50']:.2f}x) and {r.p99_ms - d.p99_ms:.2f} ms at p99 ({ratio['p99']:.2f}x) "
        f"to a 1-token completion, and sustains {r.requests_per_s:.1f} requests/s, "
        f"{ratio['requests_per_s']:.2f}x of direct decode-handle calls"
    )


def write_json(path: Path, report: Report, config: ClusterConfig) -> None:
    data = {
        **asdict(report),
        "ratios": report.ratios(),
        "model": config.model,
        "prefill_replicas": config.prefill_replicas if config.mode == "disagg" else 0,
        "decode_replicas": config.decode_replicas,
        "prompt_len": PROMPT_LEN,
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


# -- main --------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: demo model)")
    parser.add_argument("--mode", choices=["colocated", "disagg"], default="colocated")
    parser.add_argument("--requests", type=int, default=200, help="timed sequential requests")
    parser.add_argument("--warmup", type=int, default=20, help="untimed requests first")
    parser.add_argument("--concurrency", type=int, default=16, help="clients in the load test")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load per side")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    parser.add_argument("--prefill-replicas", type=int, default=1)
    parser.add_argument("--decode-replicas", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    for name in ("requests", "concurrency", "duration"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    from pdserve.demo.model import resolve_model

    mode: Mode = args.mode
    return ClusterConfig(
        model=str(resolve_model(args.model).resolve()),
        mode=mode,
        prefill_replicas=args.prefill_replicas,
        decode_replicas=args.decode_replicas,
        num_threads=args.threads,
    )


def main() -> int:
    print_machine()  # the CPU and its flags, with every figure
    args = parse_args()
    config = cluster_config(args)
    with running_cluster(config, args.port or free_port(HOST)) as url:
        report = asyncio.run(measure(url, config, args))
    what = f"{config.decode_replicas} decode"
    if config.mode == "disagg":
        what = f"{config.prefill_replicas} prefill + {what}"
    print(
        f"\nmode {config.mode} ({what} replicas), model {config.model_id}, "
        f"{PROMPT_LEN}-token prompt, max_tokens 1, client {report.client}; "
        f"latency over {args.requests} sequential requests after {args.warmup} warm-up"
    )
    print(markdown_table(report))
    print(summary(report))
    if args.json is not None:
        write_json(args.json, report, config)
    return 0


if __name__ == "__main__":
    code = main()
    # the cluster it ran in this process is stopped: skip the interpreter's final
    # collections over its heap (~2 s of the exit on 2 cores, freeing nothing needed)
    gc.freeze()
    sys.exit(code)
