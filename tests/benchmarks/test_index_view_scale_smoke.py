"""`benchmarks/index_view_scale.py --smoke` runs and reports one row per size."""

from __future__ import annotations

import subprocess
import sys


def test_index_view_scale_smoke_reports_a_row() -> None:
    argv = [sys.executable, "-m", "pdserve.benchmarks.index_view_scale", "--smoke"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0][0].strip() == "blocks" and len(rows) == 2, proc.stdout
    blocks, *figures = (cell.strip().replace(",", "") for cell in rows[1])
    assert int(blocks) >= 20000  # the view holds the size asked for
    assert all(float(f) > 0 for f in figures), rows[1]
