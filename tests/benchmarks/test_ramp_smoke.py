"""`benchmarks/ramp.py --quick` end to end, fixed pools against the planner: both
clusters start, the ramp's requests all complete (none shed, none lost), the table
reads back the pools sampled during each phase, and `--out` writes the requests and the
plot. Timings and attainment are the benchmark's to report, not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster  # tests/conftest.py, 'test tiers'


def test_ramp_benchmark_runs_fixed_pools_and_the_planner(tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "pdserve.benchmarks.ramp", "--quick",
        "--configs", "fixed", "planner", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("CPU: ")
    start = lines.index(next(x for x in lines if x.startswith("| config")))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.split("|")[1:-1]]
        rows[cells[0]] = cells[1:]
    assert list(rows) == ["fixed", "planner"], proc.stdout
    for _, _, _, shed, lost, hold, shift, _ in rows.values():
        assert (shed, lost) == ("0", "0"), proc.stdout
        assert hold != "-" and shift != "-"  # pools sampled in both phases
    assert rows["fixed"][2] == "1.00x" and rows["fixed"][5] == "2.0 / 2.0"
    assert rows["fixed"][7] == "0 / 0"  # fixed pools: nothing removed or added
    runs = json.loads((tmp_path / "ramp.json").read_text())
    n = len(runs["fixed"]["records"])
    assert n > 0 and len(runs["planner"]["records"]) == n
    assert all(r["success"] for run in runs.values() for r in run["records"])
    assert (tmp_path / "ramp.png").stat().st_size > 0
