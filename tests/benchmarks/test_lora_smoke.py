"""`benchmarks/lora.py --quick` end to end (tiny model): every row of its table is there,
and the adapters ran (their requests' tokens differ from the base's). Timings are
printed, not asserted."""

from __future__ import annotations

import subprocess
import sys


def test_lora_benchmark_runs_on_the_tiny_model() -> None:
    argv = [sys.executable, "-m", "pdserve.benchmarks.lora", "--quick"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("CPU: ")
    start = lines.index(next(x for x in lines if x.startswith("| run")))
    rows = {}
    for line in lines[start + 2 :]:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        rows[cells[0]] = cells[1:]
    assert list(rows) == ["base", "1 adapter", "4 adapters"], proc.stdout
    assert rows["base"][1] == "1.00x" and rows["base"][2] == "0/8"
    for name in ("1 adapter", "4 adapters"):
        assert float(rows[name][0].replace(",", "")) > 0
        differ = int(rows[name][2].split("/")[0])
        assert differ > 0, rows  # random adapters change greedy tokens: they ran
