"""Ray workers started with pdserve's environment run at nice 0, not Ray's default 15.

At nice 15 the engine's OpenMP threads rank below the raylet, GCS and every other
nice-0 process on the node, and each of their wake-ups stalls a parallel region
(deploy/serve_env.py). A real local Ray cluster in a subprocess, started as `pdserve up`
starts its own (SERVE_ENV applied to the environment before `ray.init`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.deploy.serve_env import SERVE_ENV, apply_serve_env

pytestmark = pytest.mark.cluster  # starts Ray (tests/conftest.py, 'test tiers')

_SCRIPT = """
import os, ray
ray.init(address="local", include_dashboard=False, num_cpus=1, log_to_driver=False)
try:
    @ray.remote(num_cpus=0)
    def priority():
        return os.getpriority(os.PRIO_PROCESS, 0)
    print("WORKER_NICE", ray.get(priority.remote(), timeout=120))
finally:
    ray.shutdown()
"""


def _worker_nice(env: dict[str, str]) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("WORKER_NICE"))
    return int(line.split()[1])


def test_workers_run_at_nice_zero_with_pdserve_env() -> None:
    assert SERVE_ENV["RAY_worker_niceness"] == "0"
    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
    apply_serve_env(env)
    assert _worker_nice(env) == os.getpriority(os.PRIO_PROCESS, 0)


def test_ray_alone_would_renice_its_workers() -> None:
    """The twin: without the setting Ray's workers run above our own niceness (the
    default this module exists to undo), so the test above measures the setting."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
    assert _worker_nice(env) > os.getpriority(os.PRIO_PROCESS, 0)
