"""`pdserve bench`: its arguments, and the command they run.

The command line (`deploy/cli.py`) builds its parser from here, loading this module by
name: the benchmarks sit above `deploy/` in the import layers, and a plain `pdserve up`
imports nothing more than argparse from them (the runs import what they need).
"""

from __future__ import annotations

import argparse


def run_bench(args: argparse.Namespace) -> int:
    if args.compare:
        from pdserve.benchmarks.compare import compare_from_args

        return compare_from_args(args)
    if args.priority_mix:
        from pdserve.benchmarks.priority_mix import run_priority_mix

        return run_priority_mix(args)
    from pdserve.benchmarks.bench_cli import run_from_args

    return run_from_args(args)


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible server (streaming); write a report"
    )
    bench.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="base URL, without /v1 (an API key, if needed: $OPENAI_API_KEY)",
    )
    bench.add_argument("--model-id", default=None, help="default: the first of GET /v1/models")
    bench.add_argument(
        "--workload",
        default="shared-prefix",
        help="shared-prefix | mixed | sharegpt-like | trace:PATH (JSONL: timestamp, "
        "prompt or prompt_token_ids, output_len)",
    )
    load = bench.add_argument_group("arrivals (one of --rate, --users; a trace alone: its times)")
    load.add_argument("--rate", default=None, help="Poisson req/s; a comma list runs a sweep")
    load.add_argument("--users", type=int, default=None, help="closed loop of N users")
    load.add_argument("--num-requests", type=int, default=None, help="per run (default 100)")
    load.add_argument("--duration", type=float, default=None, help="seconds per run")
    load.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    load.add_argument(
        "--repeat-fraction",
        type=float,
        default=0.0,
        help="resend an earlier request (greedy: the same output) for this fraction of "
        "requests; the report shows the result cache's hit rate and TTFT of hits vs misses",
    )
    shape = bench.add_argument_group("workload shape (None: the workload's default)")
    for flag, kind, what in (
        ("--num-prefixes", int, "shared-prefix: K system prompts"),
        ("--prefix-len", int, "shared-prefix: tokens per system prompt"),
        ("--suffix-len", int, "shared-prefix: user tokens per request"),
        ("--output-len", int, "shared-prefix: output tokens; sharegpt-like: median"),
        ("--prompt-len", int, "sharegpt-like: median prompt tokens"),
        ("--sigma", float, "sharegpt-like: log-normal shape"),
        ("--long-fraction", float, "mixed: fraction of long-prompt/short-output requests"),
        ("--long-prompt-len", int, "mixed"),
        ("--short-output-len", int, "mixed"),
        ("--short-prompt-len", int, "mixed"),
        ("--long-output-len", int, "mixed"),
    ):
        shape.add_argument(flag, type=kind, default=None, help=what)
    model = bench.add_argument_group("fallbacks when GET /v1/models does not say")
    model.add_argument("--vocab-size", type=int, default=512, help="(the demo model's)")
    model.add_argument("--max-model-len", type=int, default=2048, help="(the demo model's)")
    limits = bench.add_argument_group("client deadlines and objectives (seconds)")
    limits.add_argument("--first-token-timeout", type=float, default=60.0)
    limits.add_argument("--stall-timeout", type=float, default=30.0, help="between tokens")
    limits.add_argument("--slo-ttft", type=float, default=None, help="goodput: TTFT at most")
    limits.add_argument("--slo-tpot", type=float, default=None, help="goodput: TPOT at most")
    bench.add_argument("--out", default="bench-out", help="directory for the report")
    cmp = bench.add_argument_group("--compare: start configurations here and compare them")
    cmp.add_argument(
        "--compare",
        action="store_true",
        help="disagg vs colocated on `mixed`, placements on `shared-prefix`; prints ratios",
    )
    cmp.add_argument("--model", default=None, help="model folder for the clusters (demo)")
    cmp.add_argument("--mixed-rate", type=float, default=4.0, help="req/s of the mixed runs")
    cmp.add_argument("--shared-rate", type=float, default=2.0, help="req/s, shared-prefix")
    cmp.add_argument("--prefill-replicas", type=int, default=3, help="shared-prefix runs")
    cmp.add_argument(
        "--compare-only", action="append", choices=["mixed", "shared-prefix"], default=None
    )
    cmp.add_argument("--transport", choices=["grpc", "ucx"], default="grpc", help="KV transport")
    prio = bench.add_argument_group("--priority-mix: a flood mixing priorities, per priority")
    prio.add_argument(
        "--priority-mix",
        default=None,
        help="PRIORITY:WEIGHT,... e.g. 0:0.8,10:0.2 (larger = more important); one --rate",
    )
    prio.add_argument(
        "--start-cluster", action="store_true", help="start one here (--model, --up-flags)"
    )
    prio.add_argument("--up-flags", default="", help="more `pdserve up` flags (--start-cluster)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(func=run_bench)
