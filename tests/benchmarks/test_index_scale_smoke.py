"""`benchmarks/index_scale.py --smoke` end to end, as a user runs it.

One run of the script in its own process session: it starts a real redis-server, loads
the index through `cluster/prefix_index.py` with a few simulated workers, churns and
places for a second per size. The test checks that it completes, prints a table per size
and the summary with the expected rows, that the figures agree with each other (the
block count Redis holds is the one the load aimed at, memory per block is positive,
every placement found what the fleet holds), and that nothing of its session survives
it: the redis-server it started is gone. Timings are not asserted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.deploy.redis_server import session_members, wait_session_empty

pytestmark = pytest.mark.redis  # tests/conftest.py, 'test tiers'

RUN_TIMEOUT_S = 120.0  # ~3 s on an idle 2-core box
SMOKE_SIZES = (2000, 5000)  # what --smoke loads
ROWS = (
    "| blocks indexed |",
    "| load: events/s |",
    "| memory per block |",
    "| churn events/s |",
    "| placements/s |",
    "| match p50 / p99 (ms) |",
    "| PING p50 / p99 (ms) |",
    "| found: popular |",
    "| view: match p50 / p99 (ms) |",
    "| view: event lag p50 / p99 (ms) |",
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_index_scale_smoke_runs_and_stops_its_redis(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    argv = [sys.executable, "-m", "pdserve.benchmarks.index_scale", "--smoke", "--json", str(out)]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.returncode is None:  # timed out: end the run and everything it started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        left = wait_session_empty(proc.pid, timeout_s=15.0)
        if left:  # only this run's processes, so the next test starts clean
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-4000:]
    assert not left, f"processes left behind: {left}"
    assert not session_members(proc.pid)

    for size in SMOKE_SIZES:
        assert f"## {size:,} blocks, 8 workers" in stdout, stdout
    lines = stdout.splitlines()
    for row in ROWS:
        assert sum(line.startswith(row) for line in lines) == len(SMOKE_SIZES), (row, stdout)
    assert "## summary" in stdout and "| blocks | entries | events/s | B/block |" in stdout

    figures = json.loads(out.read_text())
    assert [s["blocks"] for s in figures] == list(SMOKE_SIZES)
    for s in figures:
        assert s["block_keys"] == s["blocks"]  # DBSIZE agrees with what was loaded
        assert s["entries"] > s["blocks"]  # shared prompts: one block, many workers
        assert s["load_events"] > 0 and s["events_per_s"] > 0
        assert s["bytes_per_block"] > 0 and s["bytes_per_entry"] > 0
        assert s["used_memory"] > 0
        assert s["churn_events_per_s"] > 0 and s["heartbeats_per_s"] > 0
        assert s["placements"] > 0 and s["placements_per_s"] > 0
        assert 0 < s["match_p50_ms"] <= s["match_p99_ms"]
        assert s["match_p50_ms"] <= s["place_p50_ms"]
        assert 0 < s["ping_p50_ms"] <= s["ping_p99_ms"]
        assert s["idle_miss_ms"] > 0 and s["idle_hit_ms"] > 0
        assert s["counts"]["popular"] > 0, s["counts"]  # 60% of ~40 placements
        # nothing evicts a worker's whole tail in a second, so every kind finds what it should
        assert s["found"]["popular"] == 1.0
        assert s["found"]["miss"] == 1.0
        if s["counts"]["turn"]:
            assert s["found"]["turn"] == 1.0
        # the router's in-memory view, next to the Lua match: it followed the churn and
        # answered as Redis did (a match may see an event a few ms before the other does)
        assert s["view_lag_events"] > 0 and 0 <= s["view_lag_p50_ms"] <= s["view_lag_p99_ms"]
        assert s["view_sources"] == {"memory": s["placements"]}, s["view_sources"]
        assert s["view_agree"] >= 0.5, s["view_agree"]
        assert s["view_bytes_per_block"] > 0 and s["view_places_per_cpu_s"] > 0
        assert s["view_only_lag_events"] > 0 and s["view_only_match_p99_ms"] > 0
