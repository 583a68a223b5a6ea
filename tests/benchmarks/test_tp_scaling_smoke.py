"""`benchmarks/tp_scaling.py` end to end on the tiny shape: both tables print, TP=2's
ranks each hold half of TP=1's weights, and its steps spent time in all-reduces.
Timings are not asserted; the benchmark reports them."""

from __future__ import annotations

import subprocess
import sys


def test_tp_scaling_runs_on_the_tiny_shape() -> None:
    argv = [sys.executable, "-m", "pdserve.benchmarks.tp_scaling", "--shape", "tiny"]
    argv += ["--batches", "1", "4", "--steps", "4", "--prompt-len", "8"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")]
    steps = [[c.strip() for c in r] for r in rows if len(r) == 7 and r[0].strip() != "TP"]
    memory = [[c.strip() for c in r] for r in rows if len(r) == 6 and r[0].strip() != "TP"]
    assert [(r[0], r[1]) for r in steps] == [("1", "1"), ("1", "4"), ("2", "1"), ("2", "4")]
    assert all(float(r[4]) == 0 for r in steps[:2])  # TP=1: no collective at all
    assert all(float(r[4]) > 0 for r in steps[2:])  # TP=2: the driver's all-reduce time
    assert [(r[0], r[1]) for r in memory] == [("1", "0"), ("2", "0"), ("2", "1")]
    whole, rank0, rank1 = (float(r[3]) for r in memory)  # sharded MiB
    assert abs(rank0 + rank1 - whole) <= 0.02 and rank0 == rank1
