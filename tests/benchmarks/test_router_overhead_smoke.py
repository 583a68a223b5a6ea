"""`benchmarks/router_overhead.py` end to end, as a user runs it, with tiny counts.

One run of the script in its own process session (its cluster on a random model: a real
Ray, Redis and Serve app) with a handful of requests and half a second of load per side.
It checks that the run completes, prints the table, writes figures that agree with the
requests sent, and leaves no process behind: nothing of its session survives it. Timings
are not asserted; the benchmark itself reports them.
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

pytestmark = pytest.mark.cluster  # tests/conftest.py, 'test tiers'

RUN_TIMEOUT_S = 240.0  # ~25 s on an idle 2-core box: the cluster start is most of it
NUM_REQUESTS = 4


def _session_pids(session_id: int) -> dict[int, str]:
    """pid -> command line of every process still in session `session_id`.

    Ray puts its daemons in process groups of their own (setpgrp), never in a new
    session, so the session catches all of them and the Redis server too.
    """
    alive = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == session_id:
                alive[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            continue
    return {pid: cmd.decode(errors="replace") for pid, cmd in alive.items()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_router_overhead_runs_and_stops_everything(tmp_path: Path, random_model_dir: Path) -> None:
    out = tmp_path / "figures.json"
    argv = [sys.executable, "-m", "pdserve.benchmarks.router_overhead", "--mode", "colocated"]
    argv += ["--model", str(random_model_dir)]  # not the demo: that one is trained first
    argv += ["--requests", str(NUM_REQUESTS), "--warmup", "1", "--concurrency", "2"]
    argv += ["--duration", "0.5", "--json", str(out)]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        left = _session_pids(proc.pid)
        for pid in left:  # only this run's processes, so the next test starts clean
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == 0, stderr[-4000:]
    assert not left, f"processes left behind: {left}"

    assert "| p50 latency (ms) |" in stdout and "router / direct" in stdout, stdout
    assert "mode colocated" in stdout
    figures = json.loads(out.read_text())
    assert figures["mode"] == "colocated"
    for side in ("router", "direct"):
        assert figures[side]["num_timed"] == NUM_REQUESTS
        assert figures[side]["num_load_requests"] >= 2  # each client sends at least one
        assert 0 < figures[side]["p50_ms"] <= figures[side]["p99_ms"]
    assert set(figures["ratios"]) == {"p50", "p99", "requests_per_s"}
