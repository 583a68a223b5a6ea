"""`pdserve bench --priority-mix`: a flood mixing priorities, reported per priority.

    pdserve bench --priority-mix 0:0.8,10:0.2 --rate 30 --num-requests 400 \\
        [--start-cluster [--model DIR] [--up-flags "..."]] [--url URL] [--out DIR]

    # a flood that queues on 2 CPU cores: 512-token prompts at 30 req/s
    pdserve bench --priority-mix 0:0.8,10:0.2 --start-cluster --workload mixed \\
        --long-fraction 1 --long-prompt-len 512 --short-output-len 8 --rate 30 \\
        --num-requests 400

Each request of the workload (`--workload`, default shared-prefix) gets a priority
drawn from the mix (`PRIORITY:WEIGHT,...`, seeded by `--seed`) and is sent with it in
the request's `priority` field (pdserve: LARGER is MORE important; vLLM orders the
other way). Arrivals are Poisson at `--rate` (`inf`: all at once). The report gives,
per priority: requests sent, shed (429), completed, other failures, and TTFT p50/p99
of the completed; then

- `higher shed while lower admitted`: requests refused with 429 although some request
  of a lower priority was admitted (not refused) during the run. pdserve's shedding by
  priority (`--priority-headroom`) keeps it at 0 as long as the important traffic alone
  fits in the headroom;
- `TTFT p50 ratio`: the highest priority's TTFT p50 over the lowest's (the workers
  serve their queues by priority, so under a flood it falls well below 1).

With `--start-cluster`, a cluster is started here (`pdserve up`, its own Ray cluster
and Redis: the demo model unless `--model`) with `DEFAULT_UP_FLAGS` and `--up-flags`
after them (later flags win), and stopped after the run; otherwise `--url` is used.
Writes `priority_mix.json` (config, per-priority summary, every record) to `--out` and
prints the Markdown table. Returns 0 when some request completed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shlex
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pdserve.benchmarks.bench import (
    SLO,
    ClientLimits,
    ModelInfo,
    Poisson,
    RequestRecord,
    Workload,
    run_benchmark,
)
from pdserve.benchmarks.bench_report import Latency

# A small flood-ready cluster on this machine's CPUs: one prefill and one decode worker,
# 48 requests in flight per router, a quarter of the limits kept for priorities >= 1.
DEFAULT_UP_FLAGS = (
    *("--mode", "disagg", "--prefill-replicas", "1", "--decode-replicas", "1"),
    *("--replica-cpus", "0", "--threads", "1"),
    *("--max-inflight-requests", "48", "--priority-headroom", "0.25"),
)
SHED = "http_429"


def parse_mix(text: str) -> list[tuple[int, float]]:
    """`"0:0.8,10:0.2"` -> [(0, 0.8), (10, 0.2)]: priorities and their weights.

    Raises ValueError for a malformed mix, a repeated priority or a weight <= 0.
    """
    mix: list[tuple[int, float]] = []
    for part in text.split(","):
        priority, sep, weight = part.partition(":")
        try:
            entry = (int(priority), float(weight))
        except ValueError:
            entry = None
        if not sep or entry is None or not entry[1] > 0:
            raise ValueError(f"--priority-mix takes PRIORITY:WEIGHT,... (weight > 0): {text!r}")
        mix.append(entry)
    if len({p for p, _ in mix}) != len(mix):
        raise ValueError(f"--priority-mix names a priority twice: {text!r}")
    return mix


@dataclass(frozen=True)
class PriorityMix(Workload):
    """`base`'s requests, each with a priority drawn from `mix` (seeded, by index)."""

    name: ClassVar[str] = "priority-mix"
    base: Workload
    mix: tuple[tuple[int, float], ...]
    seed: int = 0

    def priority_of(self, index: int) -> int:
        """Request `index`'s priority: the same for every run with this seed."""
        rng = random.Random(f"{self.seed}:{index}")
        priorities, weights = zip(*self.mix, strict=True)
        return rng.choices(priorities, weights)[0]

    def requests(self, model: ModelInfo, seed: int) -> Iterator[Any]:
        for spec in self.base.requests(model, seed):
            yield dataclasses.replace(spec, priority=self.priority_of(spec.index))


@dataclass(frozen=True)
class PriorityStats:
    priority: int
    sent: int
    shed: int  # 429
    completed: int
    failed: int  # any other failure
    ttft: Latency  # of the completed


def summarize_by_priority(
    records: Sequence[RequestRecord], priority_of: dict[int, int]
) -> list[PriorityStats]:
    """Per priority (ascending): counts and the TTFT of completed requests."""
    stats = []
    for priority in sorted(set(priority_of.values())):
        mine = [r for r in records if priority_of[r.index] == priority]
        ttfts = [r.ttft_s for r in mine if r.success and r.ttft_s is not None]
        shed = sum(r.reason == SHED for r in mine)
        completed = sum(r.success for r in mine)
        failed = len(mine) - shed - completed
        stats.append(PriorityStats(priority, len(mine), shed, completed, failed, Latency.of(ttfts)))
    return stats


def shed_above_admitted(records: Sequence[RequestRecord], priority_of: dict[int, int]) -> int:
    """Requests refused with 429 in a run where some lower-priority request got in."""
    admitted = [priority_of[r.index] for r in records if r.reason != SHED]
    if not admitted:
        return 0
    lowest_admitted = min(admitted)
    return sum(r.reason == SHED and priority_of[r.index] > lowest_admitted for r in records)


def ttft_ratio(stats: Sequence[PriorityStats]) -> float | None:
    """The highest priority's TTFT p50 over the lowest's (None without both)."""
    low, high = stats[0].ttft.p50, stats[-1].ttft.p50
    if len(stats) < 2 or low is None or high is None or low <= 0:
        return None
    return high / low


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f}"


def render(stats: Sequence[PriorityStats], violations: int, ratio: float | None) -> str:
    lines = [
        "| priority | sent | shed (429) | completed | other failures | TTFT p50 ms | TTFT p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in stats:
        lines.append(
            f"| {s.priority} | {s.sent} | {s.shed} | {s.completed} | {s.failed} | "
            f"{_ms(s.ttft.p50)} | {_ms(s.ttft.p99)} |"
        )
    lines.append("")
    lines.append(f"higher shed while lower admitted: {violations}")
    top, bottom = stats[-1].priority, stats[0].priority
    shown = "n/a" if ratio is None else f"{ratio:.2f}"
    lines.append(f"TTFT p50 ratio (priority {top} / priority {bottom}): {shown}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _server(args: argparse.Namespace) -> Iterator[str]:
    if not args.start_cluster:
        yield args.url
        return
    from pdserve.benchmarks.compare import cluster  # starts `pdserve up` (subprocess)

    flags = [*DEFAULT_UP_FLAGS, *shlex.split(args.up_flags or "")]
    print(f"starting: pdserve up {shlex.join(flags)}", file=sys.stderr, flush=True)
    with cluster(args.model, flags) as url:
        yield url


def run_priority_mix(args: argparse.Namespace) -> int:
    from pdserve.benchmarks.bench_cli import parse_rates, workload_from_args

    mix = tuple(parse_mix(args.priority_mix))
    workload = PriorityMix(workload_from_args(args), mix, args.seed)
    rates = parse_rates(args.rate or "inf")
    if len(rates) != 1:
        raise ValueError("--priority-mix takes one --rate")
    num_requests = args.num_requests or 200
    with _server(args) as url:
        result = asyncio.run(
            run_benchmark(
                url,
                workload,
                Poisson(rates[0], seed=args.seed),
                SLO(args.slo_ttft, args.slo_tpot),
                num_requests=num_requests,
                duration_s=args.duration,
                limits=ClientLimits(args.first_token_timeout, args.stall_timeout),
                seed=args.seed,
                model_id=args.model_id,
                vocab_size=args.vocab_size,
                max_model_len=args.max_model_len,
                api_key=os.environ.get("OPENAI_API_KEY") or None,
                progress=not args.no_progress,
            )
        )
    records = result.records
    priority_of = {r.index: workload.priority_of(r.index) for r in records}
    stats = summarize_by_priority(records, priority_of)
    violations = shed_above_admitted(records, priority_of)
    ratio = ttft_ratio(stats)
    table = render(stats, violations, ratio)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "up_flags": [*DEFAULT_UP_FLAGS, *shlex.split(args.up_flags or "")]
        if args.start_cluster
        else None,
        "mix": mix,
        "by_priority": [dataclasses.asdict(s) for s in stats],
        "higher_shed_while_lower_admitted": violations,
        "ttft_p50_ratio": ratio,
        "requests": [{**r.to_json(), "priority": priority_of[r.index]} for r in records],
    }
    (out / "priority_mix.json").write_text(json.dumps(report, indent=2))
    print(table, end="", flush=True)
    print(f"pdserve bench: wrote {out / 'priority_mix.json'}", file=sys.stderr)
    return 0 if any(s.completed for s in stats) else 1
