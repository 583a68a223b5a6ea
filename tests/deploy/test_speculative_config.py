"""`pdserve up --speculative`: the decode pool speculates, the prefill pool does not, and a
bad setting is refused before anything starts, naming what is wrong."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.cluster.config import ClusterConfig, ConfigError

TIMEOUT_S = 120


def test_only_the_decode_pool_speculates() -> None:
    config = ClusterConfig(model="m", speculative="ngram:k=4,adaptive=off")
    assert config.engine_config("decode").speculative == "ngram:k=4,adaptive=off"
    assert config.engine_config("prefill").speculative is None
    assert ClusterConfig(model="m").engine_config("decode").speculative is None
    with pytest.raises(ValidationError, match=r"k \(tokens proposed per step\) must be in 1\.\.8"):
        ClusterConfig(model="m", speculative="ngram:k=9")


def test_a_draft_model_is_checked_before_anything_starts(
    make_checkpoint: Any, tmp_path: Path
) -> None:
    model = make_checkpoint()
    draft = make_checkpoint(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=1)
    config = ClusterConfig(model=str(model), speculative=f"draft:{draft},k=3")
    assert config.preflight().engine_config("decode").speculative == f"draft:{draft},k=3"
    assert config.engine_config("prefill").speculative is None
    missing = ClusterConfig(model=str(model), speculative="draft:/no/such/draft")
    with pytest.raises(ConfigError, match="speculative: speculative draft model /no/such/draft"):
        missing.preflight()
    other = tmp_path / "other-vocab"
    shutil.copytree(draft, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    with pytest.raises(ConfigError, match="vocab_size 1000 differs from the target model's 512"):
        ClusterConfig(model=str(model), speculative=f"draft:{other}").preflight()


def test_the_flag_reaches_the_engine_and_a_bad_one_is_refused(make_checkpoint: Any) -> None:
    model = Path(make_checkpoint())
    draft = Path(make_checkpoint(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=1))
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

    def up(*flags: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, str(model), *flags],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            cwd=cwd,
        )

    # (A draft's folder, given relative to here, reaches the replicas absolute.)
    result = up("--speculative", f"draft:{draft.name},k=2", cwd=draft.parent)
    assert result.returncode == 0, result.stderr
    assert f"decode draft:{draft},k=2" in result.stdout, result.stdout + result.stderr
    result = up("--speculative", "draft:/models/small,k=4")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "pdserve: error: speculative: speculative draft model /models/small: no such folder" in (
        result.stderr
    ), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
