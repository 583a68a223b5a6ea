"""`pdserve bench --compare`: one workload against configurations started here, as ratios.

    pdserve bench --compare [--model DIR] [--num-requests N] [--out DIR]

Starts each configuration with `pdserve up` (a subprocess, its own Ray cluster and
Redis), runs the workload with `run_benchmark`, stops it, and prints the ratios:

1. `mixed` (long-prompt/short-output among short-prompt/long-output) at `--mixed-rate`:
   disaggregated (1 prefill + 1 decode) vs colocated (2 decode workers that prefill
   themselves) on the same cores. The goodput ratio disagg/colocated and the p99 TPOT
   ratio disagg/colocated.
2. `shared-prefix` with `--prefill-replicas` (2+) prefill workers: prefix-aware vs
   round-robin vs random placement. Each one's prefill-pool prefix-hit rate against the
   best possible, and TTFT p50 against round-robin. Every prompt is prefilled by the
   prefill pool (`--disagg-policy always`), and a run where some were not is an error:
   the placement under test would not have seen them.

CPUs: the host's CPUs are split in two halves; prefill replicas are pinned to the first,
decode replicas to the second, and colocated decode replicas to all of them, so every
configuration runs on the same cores and prefill never steals decode's.

The best possible hit rate is that of one infinite cache that saw every earlier request
of the run: each prompt's leading full blocks already computed by some earlier request,
over all prompt tokens. No placement can beat it: a block must be computed once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.benchmarks.bench import SLO, BenchResult, ModelInfo, Poisson, run_benchmark
from pdserve.benchmarks.bench_report import Scrape, scrape_metrics
from pdserve.benchmarks.bench_workloads import Mixed, SharedPrefix, Workload
from pdserve.benchmarks.machine import print_machine
from pdserve.common.hashing import hash_block_chain, hash_namespace
from pdserve.deploy.redis_server import drain, free_port, wait_for_line

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class CompareConfig:
    model: str | None = None
    num_requests: int = 48
    seed: int = 0
    block_size: int = 16
    mixed_rate: float = 4.0
    mixed_requests: int = 160  # p99 TPOT needs many long-output requests
    shared_rate: float = 2.0
    prefill_replicas: int = 3
    scenarios: tuple[str, ...] = ("mixed", "shared-prefix")
    prefix_len: int = 1984  # of the demo model's 2048-token context
    transport: str = "grpc"  # the KV transport of the disaggregated clusters
    slo: SLO = field(default_factory=lambda: SLO(ttft_s=0.5, tpot_s=0.02))
    out: Path | None = None


def cpu_halves() -> tuple[str, str, str]:
    """(prefill CPUs, decode CPUs, all CPUs) as Linux CPU-set strings."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(len(cpus) // 2, 1)
    first, second = cpus[:half], cpus[half:] or cpus[:half]

    def text(s: Sequence[int]) -> str:
        return ",".join(map(str, s))

    return text(first), text(second), text(cpus)


STDERR_TAIL_LINES = 40  # of a cluster that failed to start, in the error


@contextlib.contextmanager
def cluster(model: str | None, flags: Sequence[str]) -> Iterator[str]:
    """Run `pdserve up FLAGS` on a free loopback port; yield its URL; stop it after."""
    with cluster_process(model, flags) as (url, _):
        yield url


@contextlib.contextmanager
def cluster_process(
    model: str | None, flags: Sequence[str]
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`cluster`, also yielding the `pdserve up` process (its pid is its session id)."""
    argv = [sys.executable, "-m", "pdserve.deploy.cli", "up", "--port", str(free_port())]
    argv += ["--model", model] if model else []
    # stderr to a file, not the void: a cluster that dies before it is ready says why
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            [*argv, *flags], stdout=subprocess.PIPE, stderr=errors, start_new_session=True
        )
        assert proc.stdout is not None
        try:
            try:
                line = wait_for_line(proc.stdout, "pdserve ready at ", START_TIMEOUT_S)
            except (EOFError, TimeoutError) as exc:
                errors.seek(0)
                tail = errors.read().decode(errors="replace").splitlines()[-STDERR_TAIL_LINES:]
                why = "\n".join(tail)
                raise RuntimeError(f"pdserve up {' '.join(flags)}: {exc}; stderr:\n{why}") from exc
            drain(proc.stdout)
            yield line.split("pdserve ready at ", 1)[1].strip(), proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def best_hit_rate(
    workload: Workload, model: ModelInfo, seed: int, n: int, block_size: int
) -> float:
    """Hit rate of one infinite cache shared by every worker (see the module docstring)."""
    namespace = hash_namespace(model.model_id)
    seen: set[bytes] = set()
    hits = total = 0
    for spec, _ in zip(workload.requests(model, seed), range(n), strict=False):
        assert isinstance(spec.prompt, list)
        hashes = hash_block_chain(spec.prompt, block_size, namespace)
        cached = 0
        while cached < len(hashes) and hashes[cached] in seen:
            cached += 1
        hits += cached * block_size
        total += len(spec.prompt)
        seen.update(hashes)
    return hits / total if total else 0.0


def model_info(url: str, vocab_size: int = 512) -> ModelInfo:
    """The served model's id and context (the demo model's vocabulary unless given)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
        card = json.loads(resp.read())["data"][0]
    return ModelInfo(card["id"], vocab_size, int(card["max_model_len"]))


def _run(
    url: str,
    workload: Workload,
    rate: float,
    cfg: CompareConfig,
    model: ModelInfo,
    num_requests: int | None = None,
) -> BenchResult:
    return asyncio.run(
        run_benchmark(
            url,
            workload,
            Poisson(rate=rate, seed=cfg.seed),
            cfg.slo,
            num_requests=num_requests or cfg.num_requests,
            seed=cfg.seed,
            model=model,
            progress=False,
        )
    )


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}x"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.1f}"


def run_compare(cfg: CompareConfig) -> dict[str, Any]:
    p_cpus, d_cpus, all_cpus = cpu_halves()
    common = ["--block-size", str(cfg.block_size), "--replica-cpus", "0", "--threads", "1"]
    common += ["--transport", cfg.transport]
    report: dict[str, Any] = {"cpus": {"prefill": p_cpus, "decode": d_cpus}}

    if "mixed" in cfg.scenarios:
        report["mixed"] = _compare_modes(cfg, common, p_cpus, d_cpus, all_cpus)
    if "shared-prefix" in cfg.scenarios:
        report["shared_prefix"] = _compare_placements(cfg, common, p_cpus, d_cpus)
    print(render(report, cfg))
    if cfg.out is not None:
        cfg.out.mkdir(parents=True, exist_ok=True)
        (cfg.out / "compare.json").write_text(json.dumps(report, indent=2))
    return report


def _compare_modes(
    cfg: CompareConfig, common: list[str], p_cpus: str, d_cpus: str, all_cpus: str
) -> dict[str, Any]:
    """`mixed`: disaggregated vs colocated, on the same cores."""

    mixed = Mixed(long_prompt_len=1536, short_output_len=8, short_prompt_len=32, long_output_len=96)
    setups = {
        "disagg": [
            *("--mode", "disagg", "--prefill-replicas", "1", "--decode-replicas", "1"),
            *("--prefill-cpus", p_cpus, "--decode-cpus", d_cpus),
        ],
        "colocated": [
            *("--mode", "colocated", "--decode-replicas", "2"),
            "--decode-cpus",
            all_cpus,
        ],
    }
    mixed_results: dict[str, BenchResult] = {}
    decisions: dict[str, float] = {}
    for name, flags in setups.items():
        print(f"compare: mixed on {name} ...", file=sys.stderr, flush=True)
        # NOTE: the router, Serve's proxy and this load generator are not pinned. Pinning
        # them to prefill's cores (so decode's are decode's alone) made disagg's p99 TPOT
        # 2x worse on 2 cores: each streamed token crosses the router, which then waits
        # behind prefill compute.
        with cluster(cfg.model, [*common, *flags]) as url:
            mixed_results[name] = _run(
                url, mixed, cfg.mixed_rate, cfg, model_info(url), cfg.mixed_requests
            )
            if name == "disagg":  # where its prompts were prefilled, and why
                decisions = _decisions(scrape_metrics(url))
    d, c = mixed_results["disagg"].summary, mixed_results["colocated"].summary
    return {
        "rate": cfg.mixed_rate,
        "goodput": {"disagg": d.goodput, "colocated": c.goodput},
        "tpot_p99_s": {"disagg": d.tpot_s.p99, "colocated": c.tpot_s.p99},
        "ttft_p50_s": {"disagg": d.ttft_s.p50, "colocated": c.ttft_s.p50},
        "succeeded": {"disagg": d.num_succeeded, "colocated": c.num_succeeded},
        "disagg_decisions": decisions,
    }


def _decisions(scrape: Scrape) -> dict[str, float]:
    """`pdserve_disagg_decisions_total` as {"where/reason": count}, zeros left out."""
    out: dict[str, float] = {}
    for (name, labels), value in scrape.items():
        if name == "pdserve_disagg_decisions_total" and value:
            tags = dict(labels)
            out[f"{tags.get('where')}/{tags.get('reason')}"] = value
    return dict(sorted(out.items()))


def check_all_remote(decisions: dict[str, float], num_requests: int, placement: str) -> None:
    """A placement run measures the prefill pool only if every prompt went there: raise,
    naming where the others went (`_decisions`' counts), when some did not."""
    remote = sum(n for key, n in decisions.items() if key.startswith("remote/"))
    if remote >= num_requests:
        return
    elsewhere = {k: int(n) for k, n in decisions.items() if not k.startswith("remote/")}
    raise RuntimeError(
        f"shared-prefix with {placement}: {num_requests - int(remote)} of {num_requests}"
        f" prompts never reached the prefill workers whose placement this measures"
        f" (decisions: {elsewhere or 'none counted'}); the hit rate would not be placement's"
    )


def _compare_placements(
    cfg: CompareConfig, common: list[str], p_cpus: str, d_cpus: str
) -> dict[str, Any]:
    """`shared-prefix`: placement policies, 2+ prefill workers."""

    shared = SharedPrefix(
        num_prefixes=max(cfg.num_requests // 3, 1),
        prefix_len=cfg.prefix_len,
        suffix_len=32,
        output_len=16,
    )
    placement_results: dict[str, BenchResult] = {}
    best = 0.0
    for placement in ("prefix-aware", "round-robin", "random"):
        # Every prompt to the prefill pool, whose placement this measures: conditionally,
        # the decode worker, which is sent and keeps every prefix, would prefill each
        # repeat itself as a short prompt, and the placement under test would see only
        # first occurrences (it then measured no better than round-robin).
        flags = [
            *("--mode", "disagg", "--placement", placement, "--disagg-policy", "always"),
            *("--prefill-replicas", str(cfg.prefill_replicas), "--decode-replicas", "1"),
            *("--prefill-cpus", p_cpus, "--decode-cpus", d_cpus),
        ]
        print(f"compare: shared-prefix with {placement} ...", file=sys.stderr, flush=True)
        with cluster(cfg.model, [*common, *flags]) as url:
            info = model_info(url)
            best = best_hit_rate(shared, info, cfg.seed, cfg.num_requests, cfg.block_size)
            result = _run(url, shared, cfg.shared_rate, cfg, info)
            check_all_remote(_decisions(scrape_metrics(url)), cfg.num_requests, placement)
            placement_results[placement] = result
    return {
        "rate": cfg.shared_rate,
        "prefill_replicas": cfg.prefill_replicas,
        "best_hit_rate": best,
        "hit_rate": {
            k: (r.summary.server.prefix_hit_rate.get("prefill") if r.summary.server else None)
            for k, r in placement_results.items()
        },
        "ttft_p50_s": {k: r.summary.ttft_s.p50 for k, r in placement_results.items()},
        "succeeded": {k: r.summary.num_succeeded for k, r in placement_results.items()},
    }


def render(report: dict[str, Any], cfg: CompareConfig) -> str:
    cpus = report["cpus"]
    lines = [f"prefill CPUs {cpus['prefill']}, decode CPUs {cpus['decode']}", ""]
    if "mixed" in report:
        lines += _render_modes(report["mixed"], cfg)
    if "shared_prefix" in report:
        lines += _render_placements(report["shared_prefix"])
    return "\n".join(lines)


def _render_modes(m: dict[str, Any], cfg: CompareConfig) -> list[str]:
    lines = [
        f"## mixed at {m['rate']:g} req/s, {cfg.mixed_requests} requests "
        f"(SLO: TTFT <= {cfg.slo.ttft_s:g} s, TPOT <= {cfg.slo.tpot_s:g} s)",
        "",
        "| config | ok | goodput (req/s) | TTFT p50 (ms) | TPOT p99 (ms) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for k in ("disagg", "colocated"):
        lines.append(
            f"| {k} | {m['succeeded'][k]} | {m['goodput'][k]:.2f} | "
            f"{_ms(m['ttft_p50_s'][k])} | {_ms(m['tpot_p99_s'][k])} |"
        )
    goodput = _ratio(m["goodput"]["disagg"], m["goodput"]["colocated"])
    tpot = _ratio(m["tpot_p99_s"]["disagg"], m["tpot_p99_s"]["colocated"])
    made = m.get("disagg_decisions") or {}
    where = ", ".join(f"{k} {v:g}" for k, v in made.items()) or "none scraped"
    return [
        *lines,
        "",
        f"disagg/colocated: goodput {goodput}, p99 TPOT {tpot}",
        f"disagg's prefill decisions (where/reason): {where}",
        "",
    ]


def _render_placements(s: dict[str, Any]) -> list[str]:
    lines = [
        f"## shared-prefix at {s['rate']:g} req/s, {s['prefill_replicas']} prefill workers; "
        f"best possible prefill hit rate {s['best_hit_rate']:.1%}",
        "",
        "| placement | ok | prefill hit rate | of best | TTFT p50 (ms) | TTFT p50 vs round-robin |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    rr = s["ttft_p50_s"]["round-robin"]
    for k in ("prefix-aware", "round-robin", "random"):
        hit = s["hit_rate"][k]
        hit_text = "n/a" if hit is None else f"{hit:.1%}"
        lines.append(
            f"| {k} | {s['succeeded'][k]} | {hit_text} | {_ratio(hit, s['best_hit_rate'])} | "
            f"{_ms(s['ttft_p50_s'][k])} | {_ratio(rr, s['ttft_p50_s'][k])} better |"
        )
    return lines


def compare_from_args(args: Any) -> int:
    """`pdserve bench --compare`: the CLI's flags -> `run_compare`."""
    print_machine()  # the CPU and its flags, with every figure
    slo = SLO(ttft_s=args.slo_ttft or 0.5, tpot_s=args.slo_tpot or 0.02)
    cfg = CompareConfig(
        model=args.model,
        num_requests=args.num_requests or CompareConfig.num_requests,
        seed=args.seed,
        mixed_rate=args.mixed_rate,
        shared_rate=args.shared_rate,
        prefill_replicas=args.prefill_replicas,
        scenarios=tuple(args.compare_only or ("mixed", "shared-prefix")),
        transport=args.transport,
        slo=slo,
        out=Path(args.out),
    )
    run_compare(cfg)
    return 0
