"""`benchmarks/multi_turn.py --quick` end to end (tiny model): every configuration serves
the same greedy tokens; the tiers serve prompt tokens the pool alone computes again, the
disk tier some of them; on two workers, fetching a turn's history from the other worker
computes fewer still; and an engine restarted on the disk folder computes fewer prompt
tokens than one on an empty folder. Timings are printed, not asserted."""

from __future__ import annotations

import subprocess
import sys


def _table(lines: list[str], header: str) -> dict[str, list[str]]:
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.split("|")[1:-1]]
        rows[cells[0]] = cells[1:]
    return rows


def _count(cell: str) -> int:
    return int(cell.split(" ")[0].replace(",", ""))


def test_multi_turn_benchmark_runs_on_the_tiny_model() -> None:
    # float32: prefix-cache reuse is token-exact there (in bfloat16 a block computed in a
    # decode step and one computed in a prefill round differently)
    argv = [sys.executable, "-m", "pdserve.benchmarks.multi_turn", "--quick", "--dtype", "float32"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("CPU: ")
    tiers = _table(lines, "| tiers")
    assert list(tiers) == ["off", "host", "host+disk"]
    two = _table(
        lines[lines.index(next(x for x in lines if x.startswith("two workers"))) :], "| tiers"
    )
    assert list(two) == ["2 workers: off", "2 workers: host+disk", "2 workers: host+disk+fetch"]
    for name, row in {**tiers, **two}.items():
        same, total = row[8].split("/")
        assert same == total, (name, row)  # greedy tokens equal the pool-only run's
        assert all(_count(cell) >= 0 for cell in row[3:7]), (name, row)  # served from
    computed = {name: _count(row[2]) for name, row in {**tiers, **two}.items()}
    assert computed["host"] < computed["off"] and computed["host+disk"] < computed["off"]
    assert _count(tiers["host"][4]) > 0  # from host
    assert _count(tiers["host+disk"][5]) > 0  # from disk
    # two workers: each turn lands away from its history; fetching it computes less
    fetch = "2 workers: host+disk+fetch"
    assert computed[fetch] < computed["2 workers: host+disk"] < computed["2 workers: off"]
    assert _count(two[fetch][6]) > 0  # from peer
    assert _count(two["2 workers: host+disk"][6]) == 0
    restart = _table(lines, "| new engine on")
    assert _count(restart["same folder"][1]) < _count(restart["empty folder"][1])
    assert _count(restart["same folder"][2]) > 0 and _count(restart["empty folder"][2]) == 0
