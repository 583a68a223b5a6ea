"""A load that rises, holds, shifts from long prompts to long outputs and falls, against
fixed pools at peak size, today's per-pool queue policies, and the planner.

    python -m pdserve.benchmarks.ramp [--peak-rate 6] [--phase-s 30]
        [--slo-ttft-ms 1500] [--slo-itl-ms 100] [--max-replicas 2] [--out DIR] [--quick]

One random Llama checkpoint (benchmarks/engine_throughput.py's `tiny`) is written to a
temporary folder. Each configuration gets a disaggregated cluster of its own (`pdserve
up`, every replica on the host's cores, `--replica-cpus 0`, one thread each):

- fixed: `--max-replicas` prefill and decode replicas throughout (sized for the peak);
- queue: each pool on its own signal between 1 and `--max-replicas` (Serve autoscaling,
  `--prefill-autoscaling` / `--decode-autoscaling`, with delays fit for this run's
  timescale);
- planner: the SLO targets (`--slo-ttft-ms`, `--slo-itl-ms` at p90) and the same bounds
  (`--planner`).

The load (seeded, the same for each): Poisson arrivals whose rate goes from
`--base-rate` up to `--peak-rate` over a phase (rise), holds there for a phase of long
prompts (`--long-prompt` tokens in, `--short-output` out), then a phase at the same rate
of short prompts and long outputs (the shift), then falls back to the base rate. Every
request is streamed (`benchmarks/bench_client.py`), its TTFT and inter-token latencies
timed; every second the live workers per pool are read from `/workers`.

Reported per configuration: SLO attainment (the share of requests whose TTFT and whose
p90 inter-token latency meet the targets), replica-seconds (and their ratio to fixed
pools'), requests shed (429, 503) and lost (any other failure: a scale-down must lose
none), the mean replicas per pool in the hold and in the shift (the shift should move
replicas from prefill to decode), and the replicas removed and added over the run.
`--out DIR` writes every request and the replica timelines (with the planner's state
each second) as JSON and, with matplotlib, `ramp.png`: replicas per pool and TTFT over
time, one panel per configuration. Prints the CPU and its flags first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.benchmarks.bench_client import ClientLimits, RequestRecord, send_request
from pdserve.benchmarks.bench_workloads import RequestSpec
from pdserve.benchmarks.compare import cluster
from pdserve.benchmarks.engine_throughput import MODELS, build_checkpoint
from pdserve.benchmarks.machine import print_machine
from pdserve.demo.model import write_random_model

CONFIGS = ("fixed", "queue", "planner")
PHASES = ("rise", "hold", "shift", "fall")


@dataclass(frozen=True)
class Arrival:
    at_s: float
    phase: str
    spec: RequestSpec


def schedule(args: argparse.Namespace, vocab: int) -> list[Arrival]:
    """The seeded arrivals of the whole run (the same for every configuration)."""
    rng = random.Random(args.seed)
    phase_s, base, peak = args.phase_s, args.base_rate, args.peak_rate

    def rate(t: float) -> float:
        if t < phase_s:  # rise
            return base + (peak - base) * t / phase_s
        if t < 3 * phase_s:  # hold, shift
            return peak
        return peak - (peak - base) * min((t - 3 * phase_s) / phase_s, 1.0)

    out: list[Arrival] = []
    t = 0.0
    while True:
        # thinning of a Poisson process of rate `peak`
        t += rng.expovariate(peak)
        if t >= 4 * phase_s:
            return out
        if rng.random() > rate(t) / peak:
            continue
        phase = PHASES[min(int(t // phase_s), 3)]
        shifted = phase in ("shift", "fall")
        prompt_len = args.short_prompt if shifted else args.long_prompt
        output_len = args.long_output if shifted else args.short_output
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        spec = RequestSpec(len(out), prompt, output_len, kind=phase, arrival_s=t)
        out.append(Arrival(t, phase, spec))


def flags_for(config: str, args: argparse.Namespace) -> list[str]:
    n = args.max_replicas
    base = [
        *("--mode", "disagg", "--replica-cpus", "0", "--threads", "1"),
        *("--dtype", "float32", "--max-prefill-queue-s", "600"),
    ]
    if config == "fixed":
        return [*base, "--prefill-replicas", str(n), "--decode-replicas", str(n)]
    if config == "queue":
        scaling = {
            "min_replicas": 1,
            "max_replicas": n,
            "upscale_delay_s": 2.0,
            "downscale_delay_s": args.hold_s,
            "look_back_period_s": 4.0,
            "metrics_interval_s": 1.0,
        }
        return [
            *base,
            *("--prefill-replicas", "1", "--decode-replicas", "1"),
            *("--prefill-autoscaling", json.dumps({**scaling, "target": 2048.0})),
            *("--decode-autoscaling", json.dumps({**scaling, "target": 16.0})),
        ]
    planner = {
        "prefill_max": n,
        "decode_max": n,
        "budget": 2 * n,
        "interval_s": 2.0,
        "hold_s": args.hold_s,
        "horizon_s": 10.0,
    }
    return [
        *base,
        *("--prefill-replicas", "1", "--decode-replicas", "1"),
        *("--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-itl-ms", f"{args.slo_itl_ms:g}"),
        *("--slo-percentile", "90", "--planner", json.dumps(planner)),
    ]


def _live(url: str) -> dict[str, Any]:
    """Live workers per pool (`/workers`), and the planner's last decision when there is
    one (`planner`: its observed traffic, predictions and targets); {} when the router
    does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/workers", timeout=10) as resp:
            body = json.loads(resp.read())
    except Exception:  # a router busy or restarting: that second is left out
        return {}
    counts: dict[str, Any] = {"prefill": 0, "decode": 0}
    for w in body["workers"]:
        counts[w["role"]] = counts.get(w["role"], 0) + 1
    for state in (body.get("planner") or {}).values():
        if state:
            counts["planner"] = {k: state.get(k) for k in ("observed", "targets", "planned")}
    return counts


async def drive(
    url: str, model_id: str, arrivals: list[Arrival]
) -> tuple[list[RequestRecord], list[tuple[float, dict[str, int]]]]:
    """Send every arrival on time, sample the pools every second; both, once all ended."""
    limits = ClientLimits(first_token_timeout_s=600.0, stall_timeout_s=120.0)
    timeline: list[tuple[float, dict[str, Any]]] = []
    start = time.perf_counter()
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            counts = await asyncio.to_thread(_live, url)
            if counts:
                timeline.append((time.perf_counter() - start, counts))
            with contextlib.suppress(TimeoutError):  # the next second's sample
                await asyncio.wait_for(done.wait(), 1.0)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        sampler = asyncio.create_task(sample())

        async def one(a: Arrival) -> RequestRecord:
            delay = a.at_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival's time in the schedule
            return await send_request(
                session, f"{url}/v1/completions", model_id, a.spec, limits, start
            )

        records = await asyncio.gather(*(one(a) for a in arrivals))
        done.set()
        await sampler
    return list(records), timeline


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(math.ceil(0.9 * len(ordered)) - 1, len(ordered) - 1)]


def summarize(
    records: list[RequestRecord],
    timeline: list[tuple[float, dict[str, Any]]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    ttft_s, itl_s = args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000
    ok = [r for r in records if r.success]
    met = [
        r
        for r in ok
        if r.ttft_s is not None and r.ttft_s <= ttft_s and (p90(r.itl_s) or 0.0) <= itl_s
    ]
    shed = sum(r.reason in ("http_429", "http_503") for r in records)
    # replica-seconds: each sample holds until the next
    replica_s = 0.0
    for (t0, counts), (t1, _) in itertools.pairwise(timeline):
        replica_s += (t1 - t0) * (counts["prefill"] + counts["decode"])
    phase_s = args.phase_s
    per_phase: dict[str, dict[str, float]] = {}
    for i, phase in enumerate(PHASES):
        inside = [c for t, c in timeline if i * phase_s <= t < (i + 1) * phase_s]
        if inside:
            per_phase[phase] = {
                pool: sum(c.get(pool, 0) for c in inside) / len(inside)
                for pool in ("prefill", "decode")
            }
    downs = ups = 0  # replicas removed and added, by pool, from one sample to the next
    for (_, before), (_, after) in itertools.pairwise(timeline):
        for pool in ("prefill", "decode"):
            change = after[pool] - before[pool]
            downs, ups = downs + max(-change, 0), ups + max(change, 0)
    return {
        "requests": len(records),
        "scale_downs": downs,
        "scale_ups": ups,
        "slo_attainment": len(met) / len(records) if records else 0.0,
        "replica_seconds": replica_s,
        "shed": shed,
        "lost": len(records) - len(ok) - shed,
        "replicas_by_phase": per_phase,
        "ttft_p90_s": p90([r.ttft_s for r in ok if r.ttft_s is not None]),
    }


def plot(runs: dict[str, dict[str, Any]], out: Path) -> Path:
    from pdserve.benchmarks.bench_plots import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3 * len(runs)), squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs.items(), strict=True):
        times = [t for t, _ in run["timeline"]]
        for pool in ("prefill", "decode"):
            ax.step(times, [c.get(pool, 0) for _, c in run["timeline"]], where="post", label=pool)
        ax.set_ylabel("replicas")
        ax.set_title(name)
        twin = ax.twinx()
        points = [(r["start_s"], r["ttft_s"]) for r in run["records"] if r["ttft_s"] is not None]
        twin.scatter([p[0] for p in points], [p[1] for p in points], s=4, c="gray", label="TTFT")
        twin.set_ylabel("TTFT s")
        ax.legend(loc="upper left")
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    path = out / "ramp.png"
    fig.savefig(path)
    return path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--phase-s", type=float, default=30.0)
    p.add_argument("--base-rate", type=float, default=0.5)
    p.add_argument("--peak-rate", type=float, default=6.0)
    p.add_argument("--long-prompt", type=int, default=768)
    p.add_argument("--short-prompt", type=int, default=32)
    p.add_argument("--short-output", type=int, default=8)
    p.add_argument("--long-output", type=int, default=128)
    p.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    p.add_argument("--slo-itl-ms", type=float, default=100.0)
    p.add_argument("--max-replicas", type=int, default=2, help="per pool")
    p.add_argument("--hold-s", type=float, default=10.0, help="scale-down hold/delay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="short phases: a smoke run")
    args = p.parse_args()
    if args.quick:
        args.phase_s, args.peak_rate, args.long_prompt, args.long_output = 4.0, 2.0, 128, 16
    return args


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    args = parse_args()
    print_machine()
    spec = MODELS["tiny"]
    arrivals = schedule(args, spec.vocab_size)
    print(
        f"{len(arrivals)} requests over 4 phases of {args.phase_s:g} s (rate {args.base_rate:g}"
        f" -> {args.peak_rate:g}/s); {args.long_prompt} in / {args.short_output} out, then"
        f" {args.short_prompt} in / {args.long_output} out; targets TTFT {args.slo_ttft_ms:g}"
        f" ms, ITL {args.slo_itl_ms:g} ms at p90; pools of 1-{args.max_replicas}",
        flush=True,
    )
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-ramp-") as tmp:
        model = build_checkpoint(spec, Path(tmp) / "tiny", write_random_model(Path(tmp) / "tok"))
        for config in args.configs:
            print(f"{config}: starting", flush=True)
            with cluster(str(model), flags_for(config, args)) as url:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
                    model_id = json.loads(resp.read())["data"][0]["id"]
                records, timeline = asyncio.run(drive(url, model_id, arrivals))
            summary = summarize(records, timeline, args)
            print(f"{config}: {json.dumps(summary)}", flush=True)
            runs[config] = {
                "summary": summary,
                "timeline": timeline,
                "records": [r.to_json() for r in records],
            }
    fixed = runs.get("fixed", {}).get("summary", {}).get("replica_seconds")
    print("\n| config | SLO attainment | replica-seconds | vs fixed | shed | lost |"
          " prefill / decode replicas, hold | shift | replicas removed / added |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, run in runs.items():
        s = run["summary"]
        ratio = f"{s['replica_seconds'] / fixed:.2f}x" if fixed else "-"
        phases = s["replicas_by_phase"]

        def pools(phase: str, phases: dict[str, dict[str, float]] = phases) -> str:
            c = phases.get(phase)
            return "-" if c is None else f"{c['prefill']:.1f} / {c['decode']:.1f}"

        print(
            f"| {name} | {100 * s['slo_attainment']:.1f}% | {s['replica_seconds']:.0f} |"
            f" {ratio} | {s['shed']} | {s['lost']} | {pools('hold')} | {pools('shift')} |"
            f" {s['scale_downs']} / {s['scale_ups']} |"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ramp.json").write_text(json.dumps(runs))
        print(f"\nwrote {args.out / 'ramp.json'} and {plot(runs, args.out)}")


if __name__ == "__main__":
    main()
