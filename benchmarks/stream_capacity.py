"""How many tokens/s one router replica streams per core, against a bare Serve stream.

    python -m pdserve.benchmarks.stream_capacity [--concurrency 64] [--max-tokens 256]
        [--duration 10] [--warmup 2] [--rounds 2] [--json PATH] [--py-spy DIR]

Starts, in this process, an embedded Redis and a local Ray cluster with Serve's HTTP
proxy, Serve set up as `deploy.app.SERVE_ENV` says (values already in the environment are
kept: set Serve's defaults there to see what the settings buy; the program starts itself
again with them set, since Serve reads them when it is first imported), and deploys two
applications side by side, each in front of its own `FakeDecode`: a decode deployment
with the decode worker's calls and items (an "accepted" item, then one "output" item per
token, the last one finished), no engine and no sleeps, so a stream goes as fast as its
consumer takes it (per request for the bare side, on a token channel for the router,
as the real decode worker serves each):

- bare (`/bare`): the least a streaming OpenAI-style Serve app does: a FastAPI ingress
  that reads the JSON body, calls FakeDecode's stream through a handle and writes one SSE
  `data: {json}` completion chunk per output item (the same chunk fields as the router's),
  then `data: [DONE]`;
- pdserve (`/pdserve`): the real `Router` deployment (router/app.py, colocated mode, the
  options `deploy.app.build_app` gives it), its decode handle bound to FakeDecode.

Then, per side in turn (`--rounds` times, the order alternating), `--concurrency` clients
in this process (aiohttp, one keep-alive connection each) stream `POST /v1/completions`
with `stream: true`, `max_tokens` `--max-tokens` and a 16-token prompt, each sending its
next request when its stream ends, for `--duration` seconds after `--warmup` seconds
untimed. Every stream must deliver exactly `max_tokens` chunks with text and `[DONE]`.

It reads the CPU time (user + system, /proc) of the side's ingress replica, the HTTP
proxy, the side's FakeDecode and this process (the clients) over the timed window, and
reports tokens/s, CPU ms per 1,000 tokens of each, tokens per ingress core-second (what
one router replica streams per core when it is the bottleneck), and the ratio pdserve /
bare of ingress CPU per token: what the router's own code (parsing, placement with its
Redis lookup, metrics, stall timeouts, the chunk building) costs over the minimum.
CPU per token depends less than tokens/s on what else the machine runs, but not
nothing (caches, how many items each wake-up finds): the machine's load average and busy
cores during the windows are printed with the figures; `--rounds` and `--duration`
average more.

With `--py-spy DIR` (py-spy on PATH), each side's ingress replica is sampled during its
timed windows, the thread holding the GIL only, and the raw stacks written to DIR
(`py-spy record --gil -f raw`, one file per side and round).
Benchmarks live here, never in tests (STYLE.md, habit 9).
"""

# NOTE: no `from __future__ import annotations` here: FastAPI must see `Request` as a
# class, not a string, in methods that Ray Serve's ingress re-binds.
import argparse
import asyncio
import contextlib
import gc
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve import Deployment

from pdserve.benchmarks.machine import print_machine
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.messages import (
    Accepted,
    ChannelHello,
    FirstItemExtras,
    OutputItem,
    SubmitReply,
)
from pdserve.common.sampling_params import SamplingParams
from pdserve.decode_worker.channels import Batch, Channels
from pdserve.deploy.app import SERVE_ENV, apply_serve_env
from pdserve.deploy.redis_server import EmbeddedRedis, free_port

HOST = "127.0.0.1"
PROMPT = [5 + i for i in range(16)]  # token ids past the 5 special tokens of the demo vocab
TOKEN_TEXT = " tok"  # every fake token's text: non-empty, so each chunk counts as a token
READY_TIMEOUT_S = 120.0  # the apps answer HTTP (the proxy learns routes after deploy)
REQUEST_TIMEOUT_S = 300.0  # one whole stream, under 64-way load on a shared 2-core box
TARGETED_ROUTER = "pdserve.router.request_router:TargetedRequestRouter"  # as build_app's
SIDES = ("bare", "pdserve")
INGRESS = {"bare": "BareIngress", "pdserve": "Router"}  # deployment names
DECODE = "FakeDecode"
CHANNEL_IDLE_S = 5.0  # as the real decode worker's
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- the fake decode pool and the bare ingress ---------------------------------------------


class FakeDecode:
    """The decode worker's calls without an engine (decode_worker/deployment.py).

    Yields its items as fast as the caller consumes them: only Serve's streaming path and
    the caller's code remain. Per request (`generate`, the bare side) that is one message
    per token; on the router's token channel, each message carries every running
    request's next item, the next "step" beginning when the router has taken one. `load`
    and `cancel_kv` answer as the real ones do, for a router that calls them (health
    without Redis; disaggregated mode).
    """

    def __init__(self) -> None:
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        self.channels = Channels()
        self._step = asyncio.Event()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_expected: bool = False,
        target_replica: str | None = None,
        kv_wait_s: float | None = None,
    ) -> AsyncIterator[Accepted | OutputItem]:
        """The per-request stream (the bare side calls it)."""
        yield self._accepted()
        for i in range(params.max_tokens):
            yield _fake_item(i, params.max_tokens, len(prompt_token_ids))

    async def channel(
        self, channel_id: str, target_replica: str | None = None
    ) -> AsyncIterator[Batch]:
        """The token channel (the router uses it): every running request's next item per
        message, as the real decode worker sends one engine step's tokens."""
        hello: ChannelHello = {"type": "channel", "worker_id": self.worker_id}
        async for batch in self.channels.serve(channel_id, hello, CHANNEL_IDLE_S):
            yield batch
            step, self._step = self._step, asyncio.Event()
            step.set()  # taken by the router: the next "step" may begin

    async def submit(
        self,
        channel_id: str,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_expected: bool = False,
        kv_wait_s: float | None = None,
        worker_id: str | None = None,
        target_replica: str | None = None,
    ) -> SubmitReply:
        channel = self.channels.get(channel_id)
        if channel is None:
            return {"type": "no_channel", "worker_id": self.worker_id}
        channel.tasks[request_id] = asyncio.create_task(
            self._run(channel, request_id, len(prompt_token_ids), params.max_tokens)
        )
        return self._accepted()

    async def abort(
        self, channel_id: str, request_id: str, target_replica: str | None = None
    ) -> bool:
        channel = self.channels.get(channel_id)
        task = channel.tasks.get(request_id) if channel is not None else None
        if task is not None:
            task.cancel()
        return task is not None

    async def _run(self, channel: Any, request_id: str, prompt_len: int, n: int) -> None:
        try:
            for i in range(n):
                step = self._step
                channel.put(request_id, _fake_item(i, n, prompt_len))
                await step.wait()
        finally:
            channel.tasks.pop(request_id, None)

    def _accepted(self) -> Accepted:
        return {
            "type": "accepted",
            "kv_expected": False,
            "worker_id": self.worker_id,
            "address": "fake:0",
        }

    async def load(self, target_replica: str | None = None) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "running": 0, "waiting": 0}

    async def cancel_kv(
        self, request_id: str, reason: str = "prefill_failed", target_replica: str | None = None
    ) -> str:
        return self.worker_id


def _fake_item(i: int, n: int, prompt_len: int) -> OutputItem:
    last = i == n - 1
    item: OutputItem = {
        "type": "output",
        "token_ids": [PROMPT[i % len(PROMPT)]],
        "text": TOKEN_TEXT,
        "finished": last,
        "finish_reason": "length" if last else None,
        "num_output_tokens": i + 1,
    }
    if i == 0:  # the real first item's extras (`_first_item_extras`)
        extras: FirstItemExtras = {
            "kv_used": False,
            "num_prompt_tokens": prompt_len,
            "num_cached_tokens": 0,
            "decode_queue_s": 0.0,
            "local_prefill_s": 0.0,
        }
        item.update(extras)
    return item


bare_api = FastAPI()


@serve.deployment(name=INGRESS["bare"])
@serve.ingress(bare_api)
class BareIngress:
    """The minimum of a streaming OpenAI-style Serve app: body in, one SSE chunk per item."""

    def __init__(self, decode: Any, model_id: str) -> None:
        self.decode = decode
        self.model_id = model_id

    @bare_api.post("/v1/completions")
    async def completions(self, request: Request) -> StreamingResponse:
        body = json.loads(await request.body())
        params = SamplingParams(
            max_tokens=int(body["max_tokens"]), temperature=0.0, ignore_eos=True
        )
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = self.decode.options(stream=True).generate.remote(
            request_id, list(body["prompt"]), params
        )
        base = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_id,
        }

        async def sse() -> AsyncIterator[str]:
            async for item in stream:
                if item["type"] != "output":
                    continue
                choice = {
                    "index": 0,
                    "finish_reason": item["finish_reason"],
                    "text": item["text"],
                    "logprobs": None,
                }
                chunk = {**base, "choices": [choice]}
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")


# -- the cluster ---------------------------------------------------------------------------


def serve_env() -> dict[str, str]:
    """SERVE_ENV as this process's environment has it (operator-set values kept).

    Set before `ray.init`, so every process of the local cluster inherits it, as under
    `pdserve up` (which gives the replicas no runtime_env then): setting e.g.
    RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=1 before the run measures Serve's default.
    """
    apply_serve_env(os.environ)
    return {name: os.environ[name] for name in SERVE_ENV}


def handles_by_reference() -> bool | None:
    """Whether handles built in this process stream through Ray object refs, not gRPC.

    Serve fixes it when `ray.serve` is first imported (RAY_SERVE_USE_GRPC_BY_DEFAULT),
    and the handles `serve.run` builds here carry it to the replicas that call through
    them. A private field of Serve's: None where this Serve version lacks it.
    """
    try:
        from ray.serve._private.handle_options import DynamicHandleOptions

        return bool(DynamicHandleOptions()._by_reference)
    except (ImportError, AttributeError, TypeError):
        return None


def deploy_apps(config: ClusterConfig) -> None:
    """Both sides, each with its own FakeDecode, with the options `build_app` uses."""
    from ray.serve.schema import LoggingConfig

    from pdserve.router.app import Router

    decode = cast(Deployment, serve.deployment(FakeDecode)).options(
        name=DECODE,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        request_router_config={"request_router_class": TARGETED_ROUTER},
        max_ongoing_requests=max(config.max_num_seqs, 16),
    )
    ingress_options: dict[str, Any] = {
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": 4096,
    }
    args = config.model_dump(mode="json")
    bare = cast(Deployment, BareIngress).options(**ingress_options)
    router = cast(Deployment, Router).options(**ingress_options)
    apps = {
        "bare": bare.bind(decode.bind(), config.model_id),
        "pdserve": router.bind(args, None, decode.bind()),
    }
    logs = LoggingConfig(log_level="WARNING", enable_access_log=False)
    for name, app in apps.items():
        serve.run(app, name=name, route_prefix=f"/{name}", blocking=False, logging_config=logs)


@contextlib.contextmanager
def running_cluster(args: argparse.Namespace) -> Iterator[tuple[str, ClusterConfig, dict]]:
    """Redis, Ray, Serve and both apps until the block ends; yields (base URL, config, env).

    Everything started is stopped on the way out, errors and Ctrl-C included.
    """
    import ray
    from ray.serve.schema import LoggingConfig

    from pdserve.demo.model import write_random_model

    port = args.port or free_port(HOST)
    with contextlib.ExitStack() as stack:
        if args.model is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-stream-"))
            model_dir = write_random_model(Path(tmp) / "random-model")
        else:
            model_dir = Path(args.model).expanduser().resolve()
        redis = stack.enter_context(EmbeddedRedis(HOST))
        config = ClusterConfig(model=str(model_dir), mode="colocated", redis_url=redis.url)
        config = config.resolved()
        env = serve_env()  # before ray.init: the local cluster's processes inherit it
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
        stack.callback(ray.shutdown)
        stack.callback(serve.shutdown)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # this process's Serve client
        quiet = LoggingConfig(log_level="WARNING", enable_access_log=False)
        serve.start(http_options={"host": HOST, "port": port}, logging_config=quiet)
        deploy_apps(config)
        yield f"http://{HOST}:{port}", config, env


# -- processes and their CPU time ----------------------------------------------------------


def _proc_stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text.rsplit(")", 1)[1].split()  # fields from "state" on (the name may hold spaces)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = _proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, summed over cores."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    total = sum(values[:8])  # without guest time, which is counted in user already
    return (total - idle) / _CLK_TCK, total / _CLK_TCK


def descendants(root: int) -> dict[int, str]:
    """pid -> command line (a Ray worker's shows its process title) of root's descendants.

    Ray started from this process (gcs, raylet, and the raylet's workers) descends from
    it; walking down from here never picks another cluster's replica on the machine.
    """
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            children.setdefault(int(_proc_stat(int(entry.name))[1]), []).append(int(entry.name))
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            found[pid] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        todo += children.get(pid, [])
    return found


def find_pids(titles: dict[str, str], timeout_s: float = 30.0) -> dict[str, int]:
    """role -> pid of the one descendant whose process title starts with titles[role]."""
    deadline = time.monotonic() + timeout_s
    while True:
        procs = descendants(os.getpid())
        found = {
            role: [pid for pid, cmd in procs.items() if cmd.startswith(title)]
            for role, title in titles.items()
        }
        if all(len(pids) == 1 for pids in found.values()):
            return {role: pids[0] for role, pids in found.items()}
        if time.monotonic() > deadline:
            raise RuntimeError(f"cannot tell the processes apart: {found} among {procs}")
        time.sleep(0.2)  # Ray sets a replica's title once its actor is created: no event


def side_processes(side: str) -> dict[str, int]:
    return find_pids(
        {
            "ingress": f"ray::ServeReplica:{side}:{INGRESS[side]}",
            "proxy": "ray::ProxyActor",
            "decode": f"ray::ServeReplica:{side}:{DECODE}",
        }
    )


# -- load ----------------------------------------------------------------------------------


def request_body(model_id: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model_id,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }


async def stream_once(session: Any, url: str, body: dict[str, Any]) -> int:
    """Stream one completion; return its tokens (SSE chunks with text).

    Raises:
        RuntimeError: not a 200, an error chunk, no `[DONE]`, or not max_tokens tokens.
    """
    tokens = 0
    done = False
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"{url} streamed an error: {chunk['error']}")
            if any(choice.get("text") for choice in chunk.get("choices", [])):
                tokens += 1
    if not done or tokens != body["max_tokens"]:
        raise RuntimeError(f"{url}: {tokens} of {body['max_tokens']} tokens, [DONE] {done}")
    return tokens


async def wait_ready(session: Any, url: str, model_id: str) -> None:
    """Until one 1-token stream succeeds (the proxy learns an app's route after deploy)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            await stream_once(session, url, request_body(model_id, 1))
            return
        except (RuntimeError, OSError) as exc:  # 404 until the route is known, refused
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready within {READY_TIMEOUT_S:g}s") from exc
            await asyncio.sleep(0.25)


async def closed_loop(
    session: Any, url: str, body: dict[str, Any], concurrency: int, duration_s: float
) -> tuple[int, int, float]:
    """(streams, tokens, seconds): `concurrency` clients, one stream at a time each.

    Every stream started before the deadline is counted and the clock stops when the last
    one ends, so nothing in flight is dropped from the figures.
    """
    deadline = time.perf_counter() + duration_s

    async def client() -> tuple[int, int]:
        streams = tokens = 0
        while time.perf_counter() < deadline:
            tokens += await asyncio.wait_for(stream_once(session, url, body), REQUEST_TIMEOUT_S)
            streams += 1
        return streams, tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return sum(c[0] for c in counts), sum(c[1] for c in counts), elapsed


# -- measurement ---------------------------------------------------------------------------


def _div(a: float, b: float) -> float:
    """a / b, NaN for b == 0 (a window too short for the 10 ms CPU clock of /proc)."""
    return a / b if b else math.nan


@dataclass
class Side:
    """One side's figures, summed over its timed windows."""

    streams: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    ingress_cpu_s: float = 0.0
    proxy_cpu_s: float = 0.0
    decode_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    machine_busy_cores: float = 0.0  # mean over the windows, all processes of the machine

    @property
    def tokens_per_s(self) -> float:
        return _div(self.tokens, self.wall_s)

    def cpu_ms_per_1k(self, cpu_s: float) -> float:
        return _div(1e6 * cpu_s, self.tokens)

    @property
    def tokens_per_ingress_core_s(self) -> float:
        return _div(self.tokens, self.ingress_cpu_s)

    def figures(self) -> dict[str, float]:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "ingress_cpu_ms_per_1k_tokens": self.cpu_ms_per_1k(self.ingress_cpu_s),
            "proxy_cpu_ms_per_1k_tokens": self.cpu_ms_per_1k(self.proxy_cpu_s),
            "decode_cpu_ms_per_1k_tokens": self.cpu_ms_per_1k(self.decode_cpu_s),
            "client_cpu_ms_per_1k_tokens": self.cpu_ms_per_1k(self.client_cpu_s),
            "tokens_per_ingress_core_s": self.tokens_per_ingress_core_s,
        }


@contextlib.contextmanager
def sampled(pid: int, out: Path | None) -> Iterator[None]:
    """py-spy records `pid` (raw stacks written to `out`) while the block runs.

    Only the thread holding the GIL is sampled (`--gil`): the Python code that runs, the
    part a change to the router's code can shrink; Ray's and gRPC's own C++ threads are
    in the CPU figures but not in these stacks.
    """
    if out is None:
        yield
        return
    argv = ["py-spy", "record", "-p", str(pid), "-r", "100", "--nonblocking", "--gil"]
    argv += ["-f", "raw"]
    proc = subprocess.Popen(
        [*argv, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if not out.exists():
            print(f"py-spy wrote nothing ({proc.returncode}): {err.decode()[-2000:]}")


async def timed_window(
    session: Any,
    url: str,
    body: dict[str, Any],
    side: Side,
    pids: dict[str, int],
    args: argparse.Namespace,
    profile: Path | None,
) -> None:
    """One timed closed loop; adds its tokens and CPU seconds to `side`."""
    watched = {**pids, "client": os.getpid()}
    with sampled(pids["ingress"], profile):
        before = {role: cpu_s(pid) for role, pid in watched.items()}
        busy0, total0 = machine_busy_s()
        streams, tokens, wall = await closed_loop(
            session, url, body, args.concurrency, args.duration
        )
        busy1, total1 = machine_busy_s()
        after = {role: cpu_s(pid) for role, pid in watched.items()}
    used = {role: after[role] - before[role] for role in watched}
    cores = os.cpu_count() or 1
    busy = cores * (busy1 - busy0) / max(total1 - total0, 1e-9)
    side.machine_busy_cores = (side.machine_busy_cores * side.wall_s + busy * wall) / (
        side.wall_s + wall
    )
    side.streams += streams
    side.tokens += tokens
    side.wall_s += wall
    side.ingress_cpu_s += used["ingress"]
    side.proxy_cpu_s += used["proxy"]
    side.decode_cpu_s += used["decode"]
    side.client_cpu_s += used["client"]


async def measure(base_url: str, model_id: str, args: argparse.Namespace) -> dict[str, Side]:
    import aiohttp

    urls = {side: f"{base_url}/{side}/v1/completions" for side in SIDES}
    body = request_body(model_id, args.max_tokens)
    pids = {side: side_processes(side) for side in SIDES}
    sides = {side: Side() for side in SIDES}
    # One connection per client, kept alive: neither side pays a handshake per stream.
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for side in SIDES:
            await wait_ready(session, urls[side], model_id)
            if args.warmup > 0:
                await closed_loop(session, urls[side], body, args.concurrency, args.warmup)
        for round_ in range(args.rounds):
            order = SIDES if round_ % 2 == 0 else SIDES[::-1]  # ABBA: drift hits both
            for side in order:
                profile = args.py_spy / f"{side}-{round_}.txt" if args.py_spy else None
                await timed_window(
                    session, urls[side], body, sides[side], pids[side], args, profile
                )
    return sides


# -- reporting -----------------------------------------------------------------------------


def ratio(sides: dict[str, Side]) -> float:
    """pdserve / bare ingress CPU per token: the acceptance figure (at most ACCEPT_RATIO)."""
    b, p = sides["bare"], sides["pdserve"]
    return _div(p.cpu_ms_per_1k(p.ingress_cpu_s), b.cpu_ms_per_1k(b.ingress_cpu_s))


ACCEPT_RATIO = 1.3


def markdown_table(sides: dict[str, Side]) -> str:
    b, p = sides["bare"], sides["pdserve"]

    def row(name: str, bv: float, pv: float, fmt: str) -> list[str]:
        return [name, format(bv, fmt), format(pv, fmt), f"{_div(pv, bv):.2f}"]

    rows = [
        ["metric", "bare Serve", "pdserve router", "pdserve / bare"],
        ["---"] * 4,
        row("tokens/s (wall)", b.tokens_per_s, p.tokens_per_s, ".0f"),
        row(
            "ingress replica CPU ms / 1k tokens",
            b.cpu_ms_per_1k(b.ingress_cpu_s),
            p.cpu_ms_per_1k(p.ingress_cpu_s),
            ".1f",
        ),
        row(
            "tokens / ingress core-second",
            b.tokens_per_ingress_core_s,
            p.tokens_per_ingress_core_s,
            ".0f",
        ),
        row(
            "HTTP proxy CPU ms / 1k tokens",
            b.cpu_ms_per_1k(b.proxy_cpu_s),
            p.cpu_ms_per_1k(p.proxy_cpu_s),
            ".1f",
        ),
        row(
            "FakeDecode CPU ms / 1k tokens",
            b.cpu_ms_per_1k(b.decode_cpu_s),
            p.cpu_ms_per_1k(p.decode_cpu_s),
            ".1f",
        ),
        row(
            "clients CPU ms / 1k tokens",
            b.cpu_ms_per_1k(b.client_cpu_s),
            p.cpu_ms_per_1k(p.client_cpu_s),
            ".1f",
        ),
        row("streams", b.streams, p.streams, "d"),
        row("machine busy cores (all)", b.machine_busy_cores, p.machine_busy_cores, ".2f"),
    ]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in rows)


def summary(sides: dict[str, Side]) -> str:
    r = ratio(sides)
    verdict = "within" if r <= ACCEPT_RATIO else "above"
    p = sides["pdserve"]
    return (
        f"router / bare ingress CPU per token: {r:.2f}x ({verdict} the {ACCEPT_RATIO:g}x "
        f"target); one router replica streams {p.tokens_per_ingress_core_s:.0f} tokens "
        f"per core-second"
    )


def write_json(
    path: Path, sides: dict[str, Side], args: argparse.Namespace, setup: dict[str, Any]
) -> None:
    data = {
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "prompt_len": len(PROMPT),
        "serve": setup,
        "load_average": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        **{side: s.figures() for side, s in sides.items()},
        "ratio_ingress_cpu_per_token": ratio(sides),
        "accept_ratio": ACCEPT_RATIO,
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


# -- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder for the router's tokenizer")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per stream")
    parser.add_argument("--duration", type=float, default=10.0, help="timed seconds per window")
    parser.add_argument("--warmup", type=float, default=2.0, help="untimed seconds per side")
    parser.add_argument("--rounds", type=int, default=2, help="timed windows per side (ABBA)")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--py-spy", type=Path, default=None, help="sample the ingresses here")
    args = parser.parse_args(argv)
    for name in ("concurrency", "max_tokens", "duration", "rounds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if not sys.platform.startswith("linux"):
        parser.error("reads CPU times from /proc: Linux only")
    if args.py_spy is not None:
        if shutil.which("py-spy") is None:
            parser.error("--py-spy needs py-spy on PATH")
        args.py_spy.mkdir(parents=True, exist_ok=True)
    return args


def reexec_with_serve_env() -> None:
    """Start this program again with SERVE_ENV in its environment, unless it is there.

    Serve reads its settings once, when `ray.serve` is first imported, and this module
    imports it before `main` runs. The handles that `serve.run` builds here, in the
    driver, carry this process's setting of RAY_SERVE_USE_GRPC_BY_DEFAULT to the replicas
    that call through them (a handle's `_by_reference` option is pickled with it), so it
    must hold when Serve is imported, not only when Ray starts.
    """
    if all(name in os.environ for name in SERVE_ENV):
        return
    apply_serve_env(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", MODULE, *sys.argv[1:]])


MODULE = "pdserve.benchmarks.stream_capacity"


def main(argv: list[str] | None = None) -> int:
    print_machine()  # the CPU and its flags, with every figure
    args = parse_args(argv)
    with running_cluster(args) as (url, config, env):
        sides = asyncio.run(measure(url, config.model_id, args))
    by_reference = handles_by_reference()
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    changed = {k: v for k, v in env.items() if SERVE_ENV[k] != v}
    hop = {True: "object refs", False: "gRPC", None: "unknown"}[by_reference]
    print(
        f"\n{args.concurrency} concurrent streams of {args.max_tokens} tokens, "
        f"{args.rounds} x {args.duration:g} s per side, {len(PROMPT)}-token prompt; "
        f"{os.cpu_count()} cores, load average {load}; Serve env "
        f"{'as pdserve up sets it' if not changed else f'overridden: {changed}'}; "
        f"ingress -> FakeDecode streams over {hop}"
    )
    print(markdown_table(sides))
    print(summary(sides))
    if args.json is not None:
        write_json(args.json, sides, args, {**env, "handles_by_reference": by_reference})
    return 0


if __name__ == "__main__":
    # Run the package module's main, so Serve pickles `pdserve.benchmarks.stream_capacity`
    # classes by reference, not this `__main__` copy by value.
    reexec_with_serve_env()
    from pdserve.benchmarks.stream_capacity import main as package_main

    code = package_main()
    # the cluster it ran in this process is stopped: skip the interpreter's final
    # collections over its heap (~2 s of the exit on 2 cores, freeing nothing needed)
    gc.freeze()
    sys.exit(code)
