"""`pdserve bench` behind its flags (defined in `deploy/cli.py`): args -> runs -> files."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from pdserve.benchmarks.bench import (
    SLO,
    Arrival,
    BenchResult,
    ClientLimits,
    ClosedLoop,
    Poisson,
    TraceTimes,
    run_benchmark,
    write_outputs,
)
from pdserve.benchmarks.bench_workloads import Trace, Workload, parse_workload
from pdserve.benchmarks.machine import print_machine

DEFAULT_NUM_REQUESTS = 100  # when neither a count nor a duration is given
_WORKLOAD_FLAGS = (
    *("num_prefixes", "prefix_len", "suffix_len", "output_len", "prompt_len", "sigma"),
    *("long_fraction", "long_prompt_len", "short_output_len", "short_prompt_len"),
    "long_output_len",
)


def parse_rates(text: str) -> list[float]:
    """`"1,2,4"` -> [1.0, 2.0, 4.0]; `inf` sends all requests at once."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"--rate takes numbers separated by commas, got {text!r}") from exc
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--rate needs rates > 0, got {text!r}")
    return rates


def workload_from_args(args: argparse.Namespace) -> Workload:
    params = {name: getattr(args, name) for name in _WORKLOAD_FLAGS}
    return parse_workload(args.workload, **params)


def arrivals_from_args(args: argparse.Namespace, workload: Workload) -> list[Arrival]:
    """One arrival process per run: each rate of --rate, --users, or a trace's times."""
    if args.rate is not None and args.users is not None:
        raise ValueError("pass --rate or --users, not both")
    if args.users is not None:
        return [ClosedLoop(args.users)]
    if args.rate is not None:
        return [Poisson(rate, seed=args.seed) for rate in parse_rates(args.rate)]
    if isinstance(workload, Trace):
        return [TraceTimes()]
    raise ValueError("pass --rate R[,R...] or --users N (a trace alone replays its timestamps)")


def run_from_args(args: argparse.Namespace) -> int:
    """Run every arrival in turn, write `--out`, print the Markdown table.

    The API key, if the server wants one, comes from $OPENAI_API_KEY (not a flag: `ps`
    shows argv).

    Returns 0 when some request succeeded, else 1.
    """
    print_machine()  # the CPU and its flags, with every figure
    workload = workload_from_args(args)
    arrivals = arrivals_from_args(args, workload)
    num_requests = args.num_requests
    if num_requests is None and args.duration is None and not isinstance(workload, Trace):
        num_requests = DEFAULT_NUM_REQUESTS

    async def run_all() -> list[BenchResult]:
        return [
            await run_benchmark(
                args.url,
                workload,
                arrival,
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
                repeat_fraction=getattr(args, "repeat_fraction", 0.0),
            )
            for arrival in arrivals
        ]

    results = asyncio.run(run_all())
    config = {k: v for k, v in vars(args).items() if k != "func"}
    out_dir = Path(args.out)
    paths = write_outputs(results, out_dir, config)
    print((out_dir / "bench.md").read_text(), end="", flush=True)
    print(f"pdserve bench: wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0 if any(r.summary.num_succeeded for r in results) else 1
