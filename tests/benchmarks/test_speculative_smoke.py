"""`benchmarks/speculative.py` end to end on the tiny model: the table prints a row per
workload and batch (a draft model's row too: the model's first layer), every request's
tokens are the same with and without speculation, and the copy workload's and the
draft's proposals are verified. Timings are not asserted; the benchmark reports them."""

from __future__ import annotations

import subprocess
import sys


def test_speculative_benchmark_runs_on_the_tiny_model() -> None:
    argv = [sys.executable, "-m", "pdserve.benchmarks.speculative", "--model", "tiny"]
    argv += ["--batches", "1", "2", "--seed-len", "8", "--output-len", "16", "--repeats", "1"]
    argv += ["--drafts", "layers:1", "--draft-options", "k=3,adaptive=off"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in r] for r in rows if r[0].strip() != "workload"]
    assert [(r[0], r[1]) for r in cells] == [
        ("copy", "1"),
        ("random", "1"),
        ("wrong", "1"),
        ("draft=1 layers", "1"),
        ("copy", "2"),
        ("random", "2"),
        ("wrong", "2"),
        ("draft=1 layers", "2"),
    ]
    for row in cells:
        same, total = row[10].split("/")
        assert same == total, row  # greedy speculation is exact
    verified = [r for r in cells if r[0] in ("copy", "draft=1 layers")]
    assert all(int(r[6]) > 0 for r in verified), cells  # proposals verified
