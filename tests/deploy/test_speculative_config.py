"""`pdserve up --speculative`: the decode pool speculates, the prefill pool does not, and a
bad setting is refused before anything starts, naming what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.cluster.config import ClusterConfig

TIMEOUT_S = 120


def test_only_the_decode_pool_speculates() -> None:
    config = ClusterConfig(model="m", speculative="ngram:k=4,adaptive=off")
    assert config.engine_config("decode").speculative == "ngram:k=4,adaptive=off"
    assert config.engine_config("prefill").speculative is None
    assert ClusterConfig(model="m").engine_config("decode").speculative is None
    with pytest.raises(ValidationError, match=r"k \(tokens proposed per step\) must be in 1\.\.8"):
        ClusterConfig(model="m", speculative="ngram:k=9")


def test_the_flag_reaches_the_engine_and_a_bad_one_is_refused(make_checkpoint: Any) -> None:
    model = Path(make_checkpoint())
    code = (
        "import sys\n"
        "from pdserve.deploy import cli\n"
        "import pdserve.deploy.up as up\n"
        "def fake_run_up(config, *args, **kw):\n"
        "    print('decode', config.engine_config('decode').speculative)\n"
        "    return 0\n"
        "up.run_up = fake_run_up\n"
        "sys.exit(cli.main(['up', '--model', *sys.argv[1:]]))\n"
    )

    def up(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, str(model), *flags],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    result = up("--speculative", "ngram:k=3,n=2")
    assert result.returncode == 0, result.stderr
    assert "decode ngram:k=3,n=2" in result.stdout, result.stdout + result.stderr
    result = up("--speculative", "draft:/models/small,k=4")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "pdserve: error:" in result.stderr and "speculative" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
