"""Where each request's time went: a summary of a folder of timelines (common/timeline.py).

Record one by running the cluster with `PDSERVE_TIMELINE_DIR=DIR` in its environment
(`pdserve up`, or any script that starts it: the variable reaches every Ray process of a
local cluster), then:

    python -m pdserve.benchmarks.timeline DIR [--json OUT]

It prints, per request (medians and p99 over the requests the router saw finish):
TTFT split into the router's part (arrival to dispatch), the prefill's (on a prefill
worker: queue, compute and KV push, from its report; on the decode worker: from the
engine's arrival to its first token) and the rest; the mean time per output token; and
per engine, its steps: how long a step with decode rows took with and without prefill
tokens beside them, how many prefill tokens shared a step with decodes, and in how many
chunks a prompt was prefilled. Disaggregated, also how many prompts each of the router's
decisions sent where (`pdserve_disagg_decisions_total`'s where and reason), with the
seconds of TTFT the local ones were predicted to save. The machine's CPU and flags come
first: the figures only compare on the same machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.benchmarks.machine import print_machine


def load(folder: Path) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """The router events (all routers' files together) and each engine file's events."""
    router: list[dict[str, Any]] = []
    engines: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.name.startswith("router-"):
            router.extend(events)
        elif path.name.startswith("engine-") and any(e["ev"] == "step" for e in events):
            engines[path.stem] = events
    return router, engines


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def requests(router: list[dict[str, Any]], engine_first: dict[str, float]) -> dict[str, Any]:
    """Per request: its TTFT and the parts of it, and its time per output token."""
    by_rid: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for e in router:
        if e["ev"] != "start":
            by_rid[e["rid"]].setdefault(e["ev"], e)  # a resumed request: its first attempt
    parts: dict[str, list[float]] = defaultdict(list)
    where: dict[str, int] = defaultdict(int)
    decided: dict[str, dict[str, float]] = defaultdict(lambda: {"requests": 0, "saved_s": 0.0})
    for rid, ev in by_rid.items():
        if not {"dispatch", "first", "done"} <= ev.keys():
            continue
        if ev["dispatch"].get("reason"):  # disaggregated: the router's decision, and why
            d = decided[f"{ev['dispatch']['where']}/{ev['dispatch']['reason']}"]
            d["requests"] += 1
            d["saved_s"] += ev["dispatch"].get("saved_s", 0.0)
        arrival = ev["dispatch"]["arrival"]
        ttft = ev["first"]["t"] - arrival
        parts["ttft"].append(ttft)
        parts["router"].append(ev["dispatch"]["t"] - arrival)
        tokens = ev["done"].get("tokens", 0)
        if tokens > 1:
            parts["tpot"].append((ev["done"]["t"] - ev["first"]["t"]) / (tokens - 1))
        remote = ev["first"].get("kv_used") and "prefill" in ev
        where["remote" if remote else "local"] += 1
        if remote:
            p = ev["prefill"]
            parts["prefill queue"].append(p["queue_s"])
            parts["prefill compute"].append(p["compute_s"])
            parts["KV push"].append(p["push_s"])
        elif rid in engine_first:
            parts["decode worker: arrival to first token"].append(
                engine_first[rid] - ev["dispatch"]["t"]
            )
    return {
        "requests": len(parts["ttft"]),
        "where": dict(where),
        "decisions": {k: dict(v) for k, v in sorted(decided.items())},
        "ms": {k: {"p50": pct(v, 50) * 1e3, "p99": pct(v, 99) * 1e3} for k, v in parts.items()},
    }


def engine_steps(events: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's steps: durations by what they held, and how prompts were chunked."""
    steps = [e for e in events if e["ev"] == "step"]
    added = {e["rid"]: e["t"] for e in events if e["ev"] == "add" and not e.get("prefilled")}
    mixed = [s for s in steps if s["decode"] + s["verify"] and s["prefill"]]
    decode_only = [s for s in steps if s["decode"] + s["verify"] and not s["prefill"]]
    prefill_only = [s for s in steps if s["prefill"] and not s["decode"] + s["verify"]]
    chunks: dict[str, int] = defaultdict(int)
    waited: dict[str, float] = {}
    for s in steps:
        for rid, _start, _n in s["prefill"]:
            chunks[rid] += 1
            if rid in added and rid not in waited:
                waited[rid] = s["t"] - added[rid]
    # busy: of the time it had work (a step running, or requests running or waiting
    # after one), how much went to steps; an idle engine's gaps do not count
    idle = sum(
        b["t"] - (a["t"] + a["dur"])
        for a, b in itertools.pairwise(steps)
        if not (a["running"] or a["waiting"])
    )
    span = (steps[-1]["t"] + steps[-1]["dur"] - steps[0]["t"] - idle) if steps else 0.0

    def ms(group: list[dict[str, Any]]) -> dict[str, float]:
        durs = [s["dur"] for s in group]
        return {"steps": len(group), "p50": pct(durs, 50) * 1e3, "p99": pct(durs, 99) * 1e3}

    return {
        "steps": len(steps),
        "busy": sum(s["dur"] for s in steps) / span if span > 0 else float("nan"),
        "decode only ms": ms(decode_only),
        "decode + prefill ms": ms(mixed),
        "prefill only ms": ms(prefill_only),
        "prefill tokens beside decodes": {
            "p50": pct([sum(n for _, _, n in s["prefill"]) for s in mixed], 50),
            "max": max((sum(n for _, _, n in s["prefill"]) for s in mixed), default=0),
        },
        "decode rows per step p50": pct([s["decode"] + s["verify"] for s in steps], 50),
        "chunks per prompt p50": pct(list(map(float, chunks.values())), 50),
        "queue wait ms": {
            "p50": pct(list(waited.values()), 50) * 1e3,
            "p99": pct(list(waited.values()), 99) * 1e3,
        },
    }


def summarize(folder: Path) -> dict[str, Any]:
    router, engines = load(folder)
    first: dict[str, float] = {}
    for events in engines.values():
        for e in events:
            if e["ev"] == "first":
                first.setdefault(e["rid"], e["t"])
    return {
        "requests": requests(router, first),
        "engines": {k: engine_steps(v) for k, v in engines.items()},
    }


def print_summary(s: dict[str, Any]) -> None:
    r = s["requests"]
    where = ", ".join(f"{k} prefill: {v}" for k, v in r["where"].items())
    print(f"{r['requests']} requests finished ({where})")
    if r["decisions"]:  # where the router prefilled each prompt, and the predicted saving
        print(
            "decisions: "
            + ", ".join(
                f"{k} {v['requests']:.0f}"
                + (f" (saved {v['saved_s']:.1f} s)" if v["saved_s"] else "")
                for k, v in r["decisions"].items()
            )
        )
    print("| per request | p50 ms | p99 ms |")
    print("|---|---|---|")
    for k, v in r["ms"].items():
        print(f"| {k} | {v['p50']:.1f} | {v['p99']:.1f} |")
    for name, e in s["engines"].items():
        print(f"\n{name}: {e['steps']} steps, busy {e['busy']:.0%} of the time it had work")
        print("| steps | count | p50 ms | p99 ms |")
        print("|---|---|---|---|")
        for k in ("decode only ms", "decode + prefill ms", "prefill only ms"):
            v = e[k]
            print(f"| {k[:-3]} | {v['steps']} | {v['p50']:.1f} | {v['p99']:.1f} |")
        t, wait = e["prefill tokens beside decodes"], e["queue wait ms"]
        print(
            f"prefill tokens in a step beside decodes: p50 {t['p50']:.0f}, max {t['max']};"
            f" decode rows per step p50 {e['decode rows per step p50']:.0f};"
            f" chunks per prompt p50 {e['chunks per prompt p50']:.0f};"
            f" queue wait p50 {wait['p50']:.0f} ms, p99 {wait['p99']:.0f} ms"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="PDSERVE_TIMELINE_DIR of the run")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    print_machine()
    if not args.folder.is_dir():
        print(f"timeline: no folder {args.folder}", file=sys.stderr)
        return 2
    summary = summarize(args.folder)
    print_summary(summary)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
