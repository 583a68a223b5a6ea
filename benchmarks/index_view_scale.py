"""The router's in-memory index view at fleet scale: match and placement cost, memory.

    python -m pdserve.benchmarks.index_view_scale [--workers 1000]
        [--sizes 1000000,10000000] [--placements 20000] [--churn 200000] [--smoke]

`cluster/index_view.py` holds the prefix index's block entries in a router's memory and
matches a prompt's chain there, in time proportional to the chain. This builds the fleet
shape of `index_scale.py` without Redis: `--workers` workers (half prefill, half decode),
`--prompts` shared "system prompts" (chains of 8-64 blocks; prompt i held by every
(i+1)-th worker, so the first is on every worker) and unique tails per worker (random
32-byte hashes: the view treats a hash as an opaque name), until the view holds each size
of `--sizes` distinct blocks. Then, per size:

1. Churn: `--churn` events, each one worker's REMOVED of its oldest tail block and STORED
   of a new one (the block count stays put); reported as events applied per second of
   this process's CPU.
2. Placements: `--placements` of them, one at a time, each a match of one chain of 8-256
   blocks (60% a popular prompt's prefix then new blocks, 20% a worker's prompt then a
   run of its own tail, 20% all new) and then `Placer.choose_prefill` and
   `choose_decode` over every live worker (as `router/core.py` places). Reported: match
   and whole-placement latency p50/p99 (perf_counter around each) and placements per
   second of one core.
3. Memory: the process's resident memory growth per block of the view (tracemalloc's
   count would double the time; RSS includes the fleet's own bookkeeping here, so it is
   an upper bound).

The Redis path's figures at the same fleet are `index_scale.py`'s (run it for a
comparison on the same machine). Benchmarks live here, never in tests.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from pdserve.benchmarks.machine import print_machine
from pdserve.cluster.config import PlacementWeights
from pdserve.cluster.index_view import IndexView
from pdserve.cluster.prefix_index import MatchResult, WorkerInfo
from pdserve.common.hashing import hash_block_chain, hash_namespace
from pdserve.router.placement import Placer

BLOCK_SIZE = 16
MIN_CHAIN, MAX_CHAIN = 8, 256
MIN_PROMPT, MAX_PROMPT = 8, 64
GEN = 1  # every worker's generation


@dataclass
class Fleet:
    workers: list[WorkerInfo]
    prompts: list[list[bytes]]
    tails: dict[str, deque[bytes]]
    view: IndexView


def build(num_workers: int, num_prompts: int, rng: random.Random) -> Fleet:
    ns = hash_namespace("bench")
    workers = [
        WorkerInfo(
            f"{i:08x}",
            "prefill" if i % 2 == 0 else "decode",
            f"127.0.0.1:{20000 + i}",
            GEN,
            {"queued_prefill_tokens": 0, "running": 0, "kv_blocks_used": 0, "kv_blocks_total": 1},
        )
        for i in range(num_workers)
    ]
    prompts = []
    for _ in range(num_prompts):
        n = rng.randint(MIN_PROMPT, MAX_PROMPT)
        prompts.append(hash_block_chain([rng.randrange(32000) for _ in range(n * 16)], 16, ns))
    view = IndexView()
    for i, prompt in enumerate(prompts):
        for w in workers[:: i + 1]:
            view.store(w.worker_id, GEN, prompt)
    return Fleet(workers, prompts, {w.worker_id: deque() for w in workers}, view)


def grow(fleet: Fleet, size: int, rng: random.Random) -> None:
    """Tail blocks, spread evenly, until the view holds `size` blocks."""
    view, workers = fleet.view, fleet.workers
    while len(view) < size:
        batch = min(size - len(view), 100_000)
        for k in range(batch):
            w = workers[k % len(workers)]
            h = rng.randbytes(32)
            fleet.tails[w.worker_id].append(h)
            view.store(w.worker_id, GEN, (h,))


def churn(fleet: Fleet, n: int, rng: random.Random) -> float:
    """Apply `n` REMOVED + STORED pairs; events per CPU second."""
    start = time.process_time()
    workers = fleet.workers
    for _ in range(n):
        w = workers[rng.randrange(len(workers))].worker_id
        tail = fleet.tails[w]
        if tail:
            fleet.view.remove(w, GEN, (tail.popleft(),))
        h = rng.randbytes(32)
        tail.append(h)
        fleet.view.store(w, GEN, (h,))
    return 2 * n / max(time.process_time() - start, 1e-9)


def query(fleet: Fleet, rng: random.Random) -> list[bytes]:
    n = rng.randint(MIN_CHAIN, MAX_CHAIN)
    roll = rng.random()
    if roll < 0.6:
        head = fleet.prompts[min(int(rng.expovariate(0.5)), len(fleet.prompts) - 1)]
    elif roll < 0.8:
        w = fleet.workers[rng.randrange(len(fleet.workers))]
        tail = list(fleet.tails[w.worker_id])[:MAX_CHAIN]
        head = fleet.prompts[0] + tail
    else:
        head = []
    chain = head[:n]
    return chain + [rng.randbytes(32) for _ in range(n - len(chain))]


def place(fleet: Fleet, n: int, rng: random.Random) -> tuple[list[float], list[float], float]:
    placer = Placer("prefix-aware", PlacementWeights(), BLOCK_SIZE, rng)
    live = {w.worker_id: GEN for w in fleet.workers}
    by_id = {w.worker_id: w for w in fleet.workers}
    matches, totals = [], []
    cpu0 = time.process_time()
    for _ in range(n):
        chain = query(fleet, rng)
        t0 = time.perf_counter()
        counts = fleet.view.match(chain, live)
        t1 = time.perf_counter()
        results = {w: MatchResult(by_id[w], c) for w, c in counts.items()}
        prefill = {w: r for w, r in results.items() if r.worker.role == "prefill"}
        decode = {w: r for w, r in results.items() if r.worker.role == "decode"}
        placer.choose_prefill(prefill, len(chain) * BLOCK_SIZE, {})
        placer.choose_decode(decode, {})
        t2 = time.perf_counter()
        matches.append(t1 - t0)
        totals.append(t2 - t1 + (t1 - t0))
    return matches, totals, n / max(time.process_time() - cpu0, 1e-9)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    print_machine()  # the CPU and its flags, with every figure
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--sizes", default="1000000,10000000")
    parser.add_argument("--placements", type=int, default=20000)
    parser.add_argument("--churn", type=int, default=200000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="20 workers, 20k blocks")
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.sizes, args.placements, args.churn = 20, "20000", 500, 2000
    rng = random.Random(args.seed)
    base_rss = rss_bytes()
    fleet = build(args.workers, args.prompts, rng)
    print(f"{args.workers} workers, {args.prompts} shared prompts", flush=True)
    print("| blocks | match p50 (us) | match p99 (us) | placement p50 (us) |", end="")
    print(" placement p99 (us) | placements/s/core | churn events/s/core | RSS B/block |")
    print("|---|---|---|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        grow(fleet, size, rng)
        per_block = (rss_bytes() - base_rss) / len(fleet.view)
        events_s = churn(fleet, args.churn, rng)
        matches, totals, rate = place(fleet, args.placements, rng)
        m, t = np.array(matches) * 1e6, np.array(totals) * 1e6
        print(
            f"| {len(fleet.view):,} | {np.percentile(m, 50):.0f} | {np.percentile(m, 99):.0f}"
            f" | {np.percentile(t, 50):.0f} | {np.percentile(t, 99):.0f} | {rate:,.0f}"
            f" | {events_s:,.0f} | {per_block:.0f} |",
            flush=True,
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    print(f"peak RSS {peak / (1 << 30):.2f} GiB")


if __name__ == "__main__":
    main()
