"""`pdserve bench`: an async, streaming load generator for any OpenAI-compatible server.

    pdserve bench --url http://127.0.0.1:8000 --workload shared-prefix --rate 1,2,4 \\
        --num-requests 200 --slo-ttft 0.5 --slo-tpot 0.05 --out bench-out

Requests go to `POST /v1/completions` with token-id prompts, `stream: true`,
`max_tokens` = the request's output length and `ignore_eos: true`, so pdserve returns
exactly that many tokens; for servers that ignore `ignore_eos` the tokens actually
received are counted (`usage` when sent, else chunks). The vocabulary size and context
come from `GET /v1/models` (pdserve's model card has `max_model_len`), falling back to
`--vocab-size` / `--max-model-len`.

Arrivals: Poisson at `--rate R` req/s (seeded; `inf` sends all at once; a comma list
runs a sweep, one run per rate, in order, on the same server), a closed loop of
`--users N`, or, for a trace, its own timestamps. A run stops after `--num-requests`
and/or after `--duration` seconds (no request starts later; those in flight finish).
Workloads: `shared-prefix`, `mixed`, `sharegpt-like`, `trace:PATH` (see
`bench_workloads`). A request fails with reason "first_token_timeout", "stall" (no
token for `--stall-timeout` s), "http_<status>", "stream_error", "incomplete",
"bad_response" or "connection_error"; a timed-out stream is closed at once, never
waited on.

Output (`--out DIR`): `bench.json` (config, per-request records, summary of each run),
`bench.md` (Markdown tables, also printed), `ttft_cdf.png`, `tpot_cdf.png`, and for a
rate sweep `goodput_vs_rate.png`. Goodput counts requests/s that succeeded with
TTFT <= `--slo-ttft` and TPOT <= `--slo-tpot`. Prefix-hit rates and the TTFT breakdown
are deltas of the server's `/metrics` over the run (absent if it has none). NOTE: behind
several router replicas, `/metrics` is one replica's view; runs of a sweep share the
server's prefix caches, so later runs may hit prefixes earlier ones stored.

Python API (for comparisons that start their own clusters):

    result = await run_benchmark(
        "http://127.0.0.1:8000",
        SharedPrefix(num_prefixes=4, prefix_len=256, suffix_len=32, output_len=64),
        Poisson(rate=4.0, seed=0),
        SLO(ttft_s=0.5, tpot_s=0.05),
        num_requests=100,           # and/or duration_s=60.0
        limits=ClientLimits(first_token_timeout_s=60.0, stall_timeout_s=30.0),
    )
    result.summary       # bench_report.Summary: percentiles, throughputs, goodput, server
    result.records       # [bench_client.RequestRecord], one per request sent
    write_outputs([result], Path("out"), config={...})  # bench.json, bench.md, PNGs

`run_benchmark(base_url, workload, arrival, slo=SLO(), *, num_requests=None,
duration_s=None, limits=ClientLimits(), seed=0, model=None, model_id=None,
vocab_size=512, max_model_len=2048, api_key=None, progress=True) -> BenchResult`;
`arrival` is `Poisson(rate, seed)`, `ClosedLoop(users)` or `TraceTimes()`; `api_key` is
sent as `Authorization: Bearer KEY` (the CLI reads `$OPENAI_API_KEY`, never argv, which
`ps` shows); `model` (a `ModelInfo`) skips `GET /v1/models`, whose card otherwise gives
the model id (unless `model_id`) and `max_model_len`, with `vocab_size` / `max_model_len`
as fallbacks. `seed` fixes the prompts; each run of a sweep reuses it, so every rate sees
the same requests. `repeat_fraction` (`--repeat-fraction`) resends an earlier request
(greedy, so the same output) in place of that fraction of new ones: the report then shows
pdserve's result-cache hit rate and the TTFT of hits and misses (from the
`x-pdserve-result-cache` response header).
`summarize(records, duration_s, slo, server=None) -> Summary` reduces records again
(e.g. under another SLO). Raises ValueError for a bad configuration.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from pdserve.benchmarks.bench_client import ClientLimits, RequestRecord, send_request
from pdserve.benchmarks.bench_report import (
    SLO,
    Scrape,
    ServerStats,
    Summary,
    parse_scrape,
    summarize,
)
from pdserve.benchmarks.bench_workloads import (
    Mixed,
    ModelInfo,
    RequestSpec,
    SharedPrefix,
    ShareGPTLike,
    Trace,
    Workload,
    parse_workload,
    with_repeats,
)

__all__ = [
    "SLO",
    "BenchResult",
    "ClientLimits",
    "ClosedLoop",
    "Mixed",
    "ModelInfo",
    "Poisson",
    "RequestRecord",
    "ShareGPTLike",
    "SharedPrefix",
    "Summary",
    "Trace",
    "TraceTimes",
    "Workload",
    "fetch_model_info",
    "parse_workload",
    "run_benchmark",
    "summarize",
    "write_outputs",
]

CONNECT_TIMEOUT_S = 10.0
INFO_TIMEOUT_S = 10.0  # GET /v1/models and /metrics


@dataclass(frozen=True)
class Poisson:
    """Open loop: exponential gaps at `rate` req/s (inf: all at once), seeded."""

    rate: float
    seed: int = 0

    @property
    def label(self) -> str:
        return f"rate {self.rate:g} req/s"


@dataclass(frozen=True)
class ClosedLoop:
    """`users` clients, each sending its next request when the last one ends."""

    users: int

    @property
    def label(self) -> str:
        return f"{self.users} users"


@dataclass(frozen=True)
class TraceTimes:
    """Each request at its trace timestamp (relative to the trace's first)."""

    @property
    def label(self) -> str:
        return "trace timestamps"


Arrival = Poisson | ClosedLoop | TraceTimes


@dataclass
class BenchResult:
    """One run: what was asked, every request's record, and their summary."""

    base_url: str
    model: ModelInfo
    workload: Workload
    arrival: Arrival
    records: list[RequestRecord]
    summary: Summary

    @property
    def label(self) -> str:
        return self.arrival.label

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "base_url": self.base_url,
            "model": asdict(self.model),
            "workload": {"name": self.workload.name, **asdict(self.workload)},  # type: ignore[call-overload]
            "arrival": {"kind": type(self.arrival).__name__, **asdict(self.arrival)},
            "summary": self.summary.to_json(),
            "requests": [r.to_json() for r in self.records],
        }


async def fetch_model_info(
    session: aiohttp.ClientSession,
    base_url: str,
    model_id: str | None,
    vocab_size: int,
    max_model_len: int,
) -> ModelInfo:
    """The served model from `GET /v1/models`; the arguments fill what it lacks.

    Raises ValueError when the server names no model and `model_id` is None.
    """
    card: dict[str, Any] = {}
    try:
        async with session.get(f"{base_url}/v1/models", timeout=_info_timeout()) as resp:
            if resp.status == 200:
                cards = (await resp.json()).get("data") or []
                card = next((c for c in cards if model_id in (None, c.get("id"))), {})
    except (aiohttp.ClientError, TimeoutError, ValueError):
        pass
    name = model_id or card.get("id")
    if not name:
        raise ValueError(f"{base_url}/v1/models names no model: pass a model id")
    return ModelInfo(
        model_id=str(name),
        vocab_size=int(card.get("vocab_size") or vocab_size),
        max_model_len=int(card.get("max_model_len") or max_model_len),
    )


def _info_timeout() -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=INFO_TIMEOUT_S)


async def _scrape(session: aiohttp.ClientSession, base_url: str) -> Scrape | None:
    """The server's /metrics, parsed; None when it has none (or it is unreadable)."""
    try:
        async with session.get(f"{base_url}/metrics", timeout=_info_timeout()) as resp:
            return parse_scrape(await resp.text()) if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


Submit = Callable[[RequestSpec], Coroutine[Any, Any, RequestRecord]]


def _schedule(
    arrival: Poisson | TraceTimes, specs: Iterator[RequestSpec]
) -> Iterator[tuple[float, RequestSpec]]:
    """(start in seconds from the run's start, request), the first at 0."""
    rng, offset_s, first_s = random.Random(getattr(arrival, "seed", 0)), 0.0, None
    for i, spec in enumerate(specs):
        if isinstance(arrival, TraceTimes):
            first_s = spec.arrival_s if first_s is None else first_s
            offset_s = (spec.arrival_s or 0.0) - (first_s or 0.0)
        elif i and math.isfinite(arrival.rate):
            offset_s += rng.expovariate(arrival.rate)
        yield offset_s, spec


async def _open_loop(
    specs: Iterator[RequestSpec], arrival: Poisson | TraceTimes, submit: Submit, stop_at: float
) -> list[RequestRecord]:
    """Start each request at its arrival time, without waiting for earlier ones."""
    start = time.perf_counter()
    tasks: list[asyncio.Task[RequestRecord]] = []
    for offset_s, spec in _schedule(arrival, specs):
        if start + offset_s >= stop_at:
            break
        await asyncio.sleep(max(start + offset_s - time.perf_counter(), 0.0))
        tasks.append(asyncio.create_task(submit(spec)))
    return [await t for t in tasks]  # each request is bounded by its own deadlines


async def _closed_loop(
    specs: Iterator[RequestSpec], users: int, submit: Submit, stop_at: float
) -> list[RequestRecord]:
    async def user() -> list[RequestRecord]:
        out = []
        while time.perf_counter() < stop_at and (spec := next(specs, None)) is not None:
            out.append(await submit(spec))
        return out

    per_user = await asyncio.gather(*(user() for _ in range(users)))
    return sorted((r for rs in per_user for r in rs), key=lambda r: r.index)


async def run_benchmark(
    base_url: str,
    workload: Workload,
    arrival: Arrival,
    slo: SLO = SLO(),  # noqa: B008 (frozen: a shared default is safe)
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
    limits: ClientLimits = ClientLimits(),  # noqa: B008
    seed: int = 0,
    model: ModelInfo | None = None,
    model_id: str | None = None,
    vocab_size: int = 512,
    max_model_len: int = 2048,
    api_key: str | None = None,
    progress: bool = True,
    repeat_fraction: float = 0.0,
) -> BenchResult:
    """Run one benchmark against `base_url` (no `/v1`); see the module docstring."""
    _check_run(workload, arrival, num_requests, duration_s)
    if repeat_fraction and isinstance(arrival, TraceTimes):
        raise ValueError("repeats need a rate or users: a resend has no trace timestamp")
    base_url = base_url.rstrip("/")
    connector = aiohttp.TCPConnector(limit=0)  # concurrency is the arrival process's to set
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        if model is None:
            model = await fetch_model_info(session, base_url, model_id, vocab_size, max_model_len)
        specs: Iterator[RequestSpec] = workload.requests(model, seed)
        if repeat_fraction:
            specs = with_repeats(specs, repeat_fraction, seed)
        specs = itertools.islice(specs, num_requests)
        before = await _scrape(session, base_url)
        bar = tqdm(
            total=num_requests,
            desc=arrival.label,
            unit="req",
            file=sys.stderr,
            disable=not progress,
        )
        url, model_id = f"{base_url}/v1/completions", model.model_id
        start = time.perf_counter()

        async def submit(spec: RequestSpec) -> RequestRecord:
            record = await send_request(session, url, model_id, spec, limits, start)
            bar.update(1)
            return record

        stop_at = start + duration_s if duration_s is not None else math.inf
        try:
            if isinstance(arrival, ClosedLoop):
                records = await _closed_loop(specs, arrival.users, submit, stop_at)
            else:
                records = await _open_loop(specs, arrival, submit, stop_at)
        finally:
            bar.close()
        elapsed_s = time.perf_counter() - start
        after = await _scrape(session, base_url)
    server = ServerStats.from_scrapes(before, after) if before and after else None
    summary = summarize(records, elapsed_s, slo, server)
    return BenchResult(base_url, model, workload, arrival, records, summary)


def _check_run(
    workload: Workload, arrival: Arrival, num_requests: int | None, duration_s: float | None
) -> None:
    if isinstance(arrival, TraceTimes) and not isinstance(workload, Trace):
        raise ValueError("trace timestamps need a trace workload: pass a rate or users")
    if isinstance(arrival, Poisson) and not arrival.rate > 0:
        raise ValueError(f"the request rate must be > 0, got {arrival.rate}")
    if isinstance(arrival, ClosedLoop) and arrival.users < 1:
        raise ValueError(f"users must be >= 1, got {arrival.users}")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if num_requests is None and duration_s is None and not isinstance(workload, Trace):
        raise ValueError("a synthetic workload is endless: give num_requests or duration_s")


def write_outputs(
    results: list[BenchResult], out_dir: Path, config: dict[str, Any] | None = None
) -> list[Path]:
    """Write bench.json, bench.md and the PNG plots into `out_dir`; return their paths."""
    from pdserve.benchmarks.bench_plots import plot_cdfs, plot_goodput
    from pdserve.benchmarks.bench_report import markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    from pdserve.benchmarks.machine import machine

    body = {"config": config or {}, "machine": machine(), "runs": [r.to_json() for r in results]}
    paths = [out_dir / "bench.json", out_dir / "bench.md"]
    paths[0].write_text(json.dumps(body, indent=1) + "\n")
    paths[1].write_text(markdown([(r.label, r.summary) for r in results]))
    paths += plot_cdfs([(r.label, r.records) for r in results], out_dir)
    sweep = [(r.arrival.rate, r.summary) for r in results if isinstance(r.arrival, Poisson)]
    if len(sweep) > 1:
        paths.append(plot_goodput(sweep, out_dir))
    return paths
