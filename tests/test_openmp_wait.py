"""Importing pdserve bounds how long torch's idle OpenMP threads spin, unless the
environment already chose (`pdserve/__init__.py` says why: libgomp's default spin made
2-thread engines on shared cores 5-13x slower than one thread).

libgomp reads its settings once, when torch loads it, so each case is a fresh interpreter
that imports pdserve, then torch, and has libgomp print what it took (OMP_DISPLAY_ENV).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# pdserve first, as every pdserve entry point (`python -m pdserve...`, Ray workers) runs it
_PROBE = "import pdserve, torch; torch.set_num_threads(2); torch.ones(1 << 20).sum()"


def _libgomp_spin_count(env: dict[str, str]) -> str:
    base = {k: v for k, v in os.environ.items() if k not in _CHOICES}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**base, **env, "OMP_DISPLAY_ENV": "VERBOSE"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", proc.stderr)
    if found is None:
        pytest.skip("torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT displayed)")
    return found.group(1)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "10000"),  # pdserve's bound
        ({"GOMP_SPINCOUNT": "2500"}, "2500"),  # the operator's own count
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"),  # libgomp's for an explicit policy
    ],
    ids=["default", "spincount-set", "policy-set"],
)
def test_libgomp_spin_is_bounded_unless_the_environment_chooses(
    env: dict[str, str], expected: str
) -> None:
    assert _libgomp_spin_count(env) == expected
