"""`benchmarks/lora_placement.py --quick` end to end: both placements' clusters start,
serve the requests through the `openai` client, and the table reads back what the
workers' heartbeats counted. The figures are the benchmark's to report; asserted here
only that they were measured (every request counted on some worker, every worker
reporting) and that ignoring adapters loads more of them: with 16 adapters over 4
workers of 4 slots, placement by prefix and load alone finds the adapter resident on
about a quarter of its choices."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster  # tests/conftest.py, 'test tiers'


def test_lora_placement_benchmark_runs_both_placements() -> None:
    argv = [sys.executable, "-m", "pdserve.benchmarks.lora_placement", "--quick"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("CPU: ")
    start = lines.index(next(x for x in lines if x.startswith("| placement")))
    rows = {}
    for line in lines[start + 2 :]:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        rows[cells[0]] = cells[1:]
    assert list(rows) == ["adapter-aware", "adapter-blind"], proc.stdout
    for _, spread, _ in rows.values():
        served = [float(n) for n in spread.split(" / ")]
        assert len(served) == 4 and sum(served) == 48, proc.stdout  # --quick: 48 measured
    assert float(rows["adapter-blind"][0]) > float(rows["adapter-aware"][0]), proc.stdout
