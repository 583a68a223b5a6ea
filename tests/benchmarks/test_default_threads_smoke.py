"""`benchmarks/default_threads.py --quick` runs, and each setting ran on the threads it
claims: one for `num_threads=1`, the usable CPUs for the other two."""

from __future__ import annotations

import os
import subprocess
import sys

from pdserve.common.engine_config import usable_cpus


def test_default_threads_benchmark_runs_each_setting_in_its_own_process() -> None:
    argv = [sys.executable, "-m", "pdserve.benchmarks.default_threads", "--quick"]
    argv += ["--dtype", "float32"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("CPU: ")
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")]
    table = {r[0].strip(): r[1].strip() for r in rows[1:]}  # setting -> threads
    n = str(usable_cpus())
    assert table == {"num_threads=1": "1", "default": n, "torch.set_num_threads(2)": n}
