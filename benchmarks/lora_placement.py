"""Adapter-aware placement: adapter loads per request, and how requests spread, with many
LoRA adapters over a pool of decode workers that each hold only a few at once.

    python -m pdserve.benchmarks.lora_placement [--workers 4] [--adapters 16]
        [--max-loras 4] [--requests 320] [--warmup 64] [--concurrency 8] [--quick]

One random Llama checkpoint (benchmarks/engine_throughput.py's `tiny`) and `--adapters`
random PEFT adapters for it (rank `--rank`, every projection) are written to a temporary
folder. Each placement then gets a cluster of its own, started with `pdserve up`
(colocated, `--workers` decode replicas, each with `--max-loras` adapter slots, so the
pool holds `workers x max-loras` adapters at once; every worker loads every adapter
into host memory at start):

- adapter-aware: the default placement weights (a worker that does not hold the
  request's adapter costs `lora_load` more, router/placement.py);
- adapter-blind: the same, with `lora_load` and `lora_load_tokens` 0: placement by
  prefix and load only, what placement did before adapters counted.

The same requests (seeded: each names one adapter, uniformly at random; unique prompts,
`--output-len` greedy tokens, ignore eos) go through the official `openai` client,
`--concurrency` at a time. The first `--warmup` fill the slots; over the rest the run
reads from the router's /metrics the adapters the workers loaded
(`pdserve_worker_lora_loads`, from their heartbeats, read once every worker reports
itself idle) and the requests each worker served (`pdserve_placements_total`).
Reported per placement: adapter loads per request, requests per worker (and the busiest
worker's share against an even one), and the requests' wall time. Prints the CPU and
its flags first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.benchmarks.bench_report import Scrape, scrape_metrics
from pdserve.benchmarks.compare import cluster
from pdserve.benchmarks.engine_throughput import MODELS, build_checkpoint
from pdserve.benchmarks.lora import write_adapter
from pdserve.benchmarks.machine import print_machine
from pdserve.demo.model import write_random_model

IDLE_TIMEOUT_S = 60.0
PLACEMENTS: dict[str, dict[str, float]] = {
    "adapter-aware": {},
    "adapter-blind": {"lora_load": 0.0, "lora_load_tokens": 0.0},
}


def _series(scrape: Scrape, name: str, label: str) -> dict[str, float]:
    """Every series of `name`, summed by the value of its `label`."""
    out: dict[str, float] = {}
    for (sample, labels), value in scrape.items():
        if sample == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out


def _idle_scrape(url: str, workers: int, timeout_s: float = IDLE_TIMEOUT_S) -> Scrape:
    """/metrics once every worker's heartbeat says it runs and waits for nothing: its
    gauges (the adapter loads among them) then count every request sent so far."""
    deadline = time.monotonic() + timeout_s
    while True:
        scrape = scrape_metrics(url)
        busy = _series(scrape, "pdserve_worker_running", "worker")
        waiting = _series(scrape, "pdserve_worker_waiting", "worker")
        if len(busy) >= workers and not any(busy.values()) and not any(waiting.values()):
            return scrape
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers did not report idle within {timeout_s:g}s")
        time.sleep(0.25)  # polling the gauges, not waiting for an event


async def _send(
    url: str, requests: list[tuple[str, str]], concurrency: int, output_len: int
) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    queue = list(reversed(requests))

    async def worker() -> None:
        while queue:
            adapter, prompt = queue.pop()
            await client.completions.create(
                model=adapter,
                prompt=prompt,
                max_tokens=output_len,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()


def run_placement(
    model: Path,
    adapters: dict[str, Path],
    weights: dict[str, float],
    requests: list[tuple[str, str]],
    args: argparse.Namespace,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    flags = [
        "--mode", "colocated",
        "--decode-replicas", str(args.workers),
        "--replica-cpus", f"{args.replica_cpus:g}",
        "--threads", "1",
        "--max-loras", str(args.max_loras),
        "--max-lora-rank", str(args.rank),
        "--max-num-seqs", str(max(args.concurrency, 8)),
        "--weights", json.dumps(weights),
    ]  # fmt: skip
    for name, path in adapters.items():
        flags += ["--lora", f"{name}={path}"]
    with cluster(str(model), flags) as url:
        warm, measured = requests[: args.warmup], requests[args.warmup :]
        asyncio.run(_send(url, warm, args.concurrency, args.output_len))
        before = _idle_scrape(url, args.workers)
        start = time.monotonic()
        asyncio.run(_send(url, measured, args.concurrency, args.output_len))
        wall_s = time.monotonic() - start
        after = _idle_scrape(url, args.workers)
    loads = sum(_series(after, "pdserve_worker_lora_loads", "worker").values()) - sum(
        _series(before, "pdserve_worker_lora_loads", "worker").values()
    )
    served_before = _series(before, "pdserve_placements_total", "worker")
    served = {
        w: n - served_before.get(w, 0.0)
        for w, n in _series(after, "pdserve_placements_total", "worker").items()
    }
    per_worker = sorted(served.values(), reverse=True)
    log(f"  {len(measured)} requests in {wall_s:.1f}s; {loads:g} adapter loads")
    return {
        "loads_per_request": loads / max(len(measured), 1),
        "requests_per_worker": per_worker,
        "busiest_share_vs_even": (
            per_worker[0] / (sum(per_worker) / args.workers) if per_worker else None
        ),
        "wall_s": wall_s,
    }


def make_requests(args: argparse.Namespace) -> list[tuple[str, str]]:
    rng = random.Random(args.seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    out = []
    for i in range(args.warmup + args.requests):
        adapter = f"a{rng.randrange(args.adapters)}"
        text = " ".join(rng.choice(words) for _ in range(args.prompt_words))
        out.append((adapter, f"request {i}: {text}"))
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--requests", type=int, default=320, help="measured, after the warm-up")
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--replica-cpus", type=float, default=0.25, help="Ray CPUs per worker")
    p.add_argument("--placements", nargs="+", choices=sorted(PLACEMENTS), default=list(PLACEMENTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="few requests: a smoke run")
    args = p.parse_args()
    if args.quick:
        args.requests, args.warmup, args.output_len = 48, 16, 4
    return args


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    args = parse_args()
    print_machine()
    spec = MODELS["tiny"]
    requests = make_requests(args)
    print(
        f"{args.workers} decode workers x {args.max_loras} adapter slots, {args.adapters}"
        f" adapters of rank {args.rank}; {args.warmup} warm-up + {args.requests} measured"
        f" requests, {args.concurrency} at a time, {args.output_len} tokens each",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-lora-placement-") as tmp:
        root = Path(tmp)
        model = build_checkpoint(spec, root / "tiny", write_random_model(root / "tok"))
        adapters = {
            f"a{i}": write_adapter(root / f"a{i}", spec, args.rank, seed=i + 1)
            for i in range(args.adapters)
        }
        for name in args.placements:
            print(f"{name}:", flush=True)
            results[name] = run_placement(model, adapters, PLACEMENTS[name], requests, args)
    print("\n| placement | adapter loads / request | requests per worker | busiest vs even |")
    print("|---|---|---|---|")
    for name, r in results.items():
        spread = " / ".join(f"{n:g}" for n in r["requests_per_worker"])
        print(
            f"| {name} | {r['loads_per_request']:.3f} | {spread} |"
            f" {r['busiest_share_vs_even']:.2f}x |"
        )


if __name__ == "__main__":
    main()
