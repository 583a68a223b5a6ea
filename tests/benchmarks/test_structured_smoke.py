"""`benchmarks/structured.py` end to end on the tiny model: it prints the compile times
of the largest schema (cold and cached) and a row per batch, and its constrained runs
emitted only what the grammar allows (the benchmark asserts it). Timings are not
asserted; the benchmark reports them."""

from __future__ import annotations

import json
import subprocess
import sys


def test_structured_benchmark_runs_on_the_tiny_model() -> None:
    argv = [sys.executable, "-m", "pdserve.benchmarks.structured", "--model", "tiny"]
    argv += ["--batches", "1", "4", "--prompt-len", "8", "--output-len", "12", "--repeats", "1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ")]
    assert [r[0].strip() for r in rows] == ["batch", "1", "4"]
    times = json.loads(lines[-1])
    assert times["compile_cached_ms"] < times["compile_cold_ms"]
