"""The `pdserve` command line, run as a real subprocess the way a user runs it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.demo_model import CACHE_DIR_ENV, DEMO_MODEL_VERSION

TIMEOUT_S = 120


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m pdserve.deploy.cli ARGS` with one OpenMP thread (2 stall a busy 2-core box)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pdserve.deploy.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def cli_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo model written by `pdserve demo-model DIR` (the subject of one test)."""
    folder = tmp_path_factory.mktemp("cli") / "demo"
    result = run_cli("demo-model", str(folder), cwd=folder.parent)
    assert result.returncode == 0, result.stderr
    assert str(folder) in result.stdout
    return folder


def test_demo_model_writes_a_model_folder(cli_model_dir: Path) -> None:
    config = json.loads((cli_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (cli_model_dir / name).is_file()


def test_generate_prints_text(cli_model_dir: Path, tmp_path: Path) -> None:
    result = run_cli(
        "generate", "--model", str(cli_model_dir), "--prompt", "The river", "--max-tokens", "5",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    summary = re.search(r"\[(\d+) tokens, finish_reason=(\w+)\]", result.stderr)
    assert summary is not None, result.stderr
    num_tokens, reason = int(summary[1]), summary[2]
    assert (num_tokens, reason) == (5, "length") or (num_tokens <= 5 and reason == "stop")


def test_generate_defaults_to_the_cached_demo_model(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = run_cli(
        "generate", "--prompt", "The river", "--max-tokens", "5",
        cwd=tmp_path, env={CACHE_DIR_ENV: str(cache)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert (cache / f"demo-model-{DEMO_MODEL_VERSION}" / "config.json").is_file()


def test_generate_with_missing_model_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    result = run_cli("generate", "--model", str(missing), "--prompt", "hi", cwd=tmp_path)
    assert result.returncode == 2
    assert str(missing) in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_console_script_is_installed(tmp_path: Path) -> None:
    script = shutil.which("pdserve")
    assert script is not None
    result = subprocess.run(
        [script, "--help"],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert "generate" in result.stdout and "demo-model" in result.stdout
