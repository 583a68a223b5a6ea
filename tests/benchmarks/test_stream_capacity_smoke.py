"""`benchmarks/stream_capacity.py` end to end, as a user runs it, with tiny counts.

One run of the script in its own process session (a real Redis, Ray and Serve with both
apps: the bare ingress and the real router, each in front of a FakeDecode) with two
8-token streams per side. It checks that the run completes, prints the table and the
acceptance ratio, writes figures that agree with the streams sent, that the driver built
its handles with SERVE_ENV in force (gRPC, not object refs: the re-exec worked), and
that nothing of its session survives it. Timings are not asserted; the benchmark itself
reports them.
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

from pdserve.deploy.app import SERVE_ENV
from pdserve.deploy.redis_server import session_members, wait_session_empty

pytestmark = pytest.mark.cluster  # tests/conftest.py, 'test tiers'

RUN_TIMEOUT_S = 240.0  # ~30 s on an idle 2-core box: the cluster start is most of it
MAX_TOKENS = 8


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stream_capacity_runs_and_stops_everything(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    argv = [sys.executable, "-m", "pdserve.benchmarks.stream_capacity"]
    argv += ["--concurrency", "2", "--max-tokens", str(MAX_TOKENS), "--duration", "1"]
    argv += ["--warmup", "0", "--rounds", "1", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in SERVE_ENV}  # as a user's shell
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        left = wait_session_empty(proc.pid, timeout_s=15.0)
        for member in left:  # only this run's processes, so the next test starts clean
            pid = int(member.split(" ", 1)[0])
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == 0, stderr[-4000:]
    assert not left, f"processes left behind: {left}"
    assert not session_members(proc.pid)

    assert "| ingress replica CPU ms / 1k tokens |" in stdout, stdout
    assert "router / bare ingress CPU per token:" in stdout, stdout
    assert "as pdserve up sets it" in stdout and "streams over gRPC" in stdout, stdout
    figures = json.loads(out.read_text())
    assert figures["serve"]["handles_by_reference"] is False
    assert {k: figures["serve"][k] for k in SERVE_ENV} == SERVE_ENV
    for side in ("bare", "pdserve"):
        f = figures[side]
        assert f["streams"] >= 2  # each client streams at least once
        assert f["tokens"] == f["streams"] * MAX_TOKENS  # every stream complete
        assert f["ingress_cpu_s"] > 0  # its replica was found and read (10 ms ticks)
    bare, pd = figures["bare"], figures["pdserve"]
    expected = (pd["ingress_cpu_s"] / pd["tokens"]) / (bare["ingress_cpu_s"] / bare["tokens"])
    assert figures["ratio_ingress_cpu_per_token"] == pytest.approx(expected)
