"""Nothing run from the checkout imports one of pdserve's folders as a top-level package.

The repository root is the package `pdserve`, and Python puts the current directory first
on `sys.path` (`python -m pytest`, `python -m pdserve...`, `python -c`): from the root,
`kernels/` used to be importable as `kernels` and shadowed Hugging Face's package of that
name, which transformers 5.25 imports (`ImportError: cannot import name 'CUDAProperties'
from 'kernels'`). Importing pdserve takes the root off `sys.path` (the root
`__init__.py`); a stand-in top-level package of each folder's name, installed where
Python looks next, must then be the one imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name != "tests")


def test_pdserves_folders_never_shadow_top_level_packages(tmp_path: Path) -> None:
    assert {"engine", "kernels", "router", "deploy", "cluster"} <= set(FOLDERS)
    site = tmp_path / "site"
    for name in FOLDERS:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("MARKER = 'stand-in'\n")
    code = (
        "import importlib, json, pdserve.engine\n"
        f"names = {FOLDERS!r}\n"
        "print(json.dumps({n: getattr(importlib.import_module(n), 'MARKER', None) for n in names}))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert imported == dict.fromkeys(FOLDERS, "stand-in"), imported
