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

from pdserve.demo.model import CACHE_DIR_ENV, DEMO_MODEL_VERSION

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
def cli_model_dir(tmp_path_factory: pytest.TempPathFactory, trained_demo_dir: Path) -> Path:
    """The demo model written by `pdserve demo-model DIR` (the subject of one test), from
    the session's cache (`trained_demo_dir`), so the suite trains it no extra time."""
    folder = tmp_path_factory.mktemp("cli") / "demo"
    env = {CACHE_DIR_ENV: str(trained_demo_dir.parent)}
    result = run_cli("demo-model", str(folder), cwd=folder.parent, env=env)
    assert result.returncode == 0, result.stderr
    assert str(folder) in result.stdout
    assert "training" not in result.stderr  # cached
    return folder


def test_demo_model_writes_the_cached_demo(cli_model_dir: Path, trained_demo_dir: Path) -> None:
    config = json.loads((cli_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    names = {"model.safetensors", "tokenizer.json", "generation_config.json", "config.json"}
    assert names <= {p.name for p in cli_model_dir.iterdir()}
    for path in trained_demo_dir.iterdir():
        assert (cli_model_dir / path.name).read_bytes() == path.read_bytes(), path.name


def test_generate_prints_text(cli_model_dir: Path, tmp_path: Path) -> None:
    result = run_cli(
        "generate", "--model", str(cli_model_dir), "--prompt", "The river", "--max-tokens", "5",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert re.search(r"[a-z]{3,}", result.stdout), result.stdout  # a word, not byte soup
    summary = re.search(r"\[(\d+) tokens, finish_reason=(\w+)\]", result.stderr)
    assert summary is not None, result.stderr
    num_tokens, reason = int(summary[1]), summary[2]
    assert (num_tokens, reason) == (5, "length") or (num_tokens <= 5 and reason == "stop")


def test_generate_defaults_to_the_cached_demo_model(tmp_path: Path, trained_demo_dir: Path) -> None:
    """(tests/engine/test_demo_model.py runs the first use, which trains it.)"""
    cache = trained_demo_dir.parent
    assert trained_demo_dir == cache / f"demo-model-{DEMO_MODEL_VERSION}"
    result = run_cli(
        "generate", "--prompt", "The river", "--max-tokens", "8",
        cwd=tmp_path, env={CACHE_DIR_ENV: str(cache)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "training" not in result.stderr
    words = re.findall(r"[A-Za-z]+", result.stdout)
    assert len(words) >= 3, result.stdout


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


def test_up_puts_serve_settings_in_place_before_serve_is_imported(random_model_dir: Path) -> None:
    """Serve fixes a handle's transport (gRPC or object refs) when `ray.serve` is first
    imported: `pdserve up` must have its settings in the environment by then."""
    code = (
        "import os, sys\n"
        "for name in list(os.environ):\n"
        "    if name.startswith('RAY_SERVE_'): del os.environ[name]\n"
        "from pdserve.deploy import cli\n"
        "assert 'ray.serve' not in sys.modules, 'the CLI imports Serve too early'\n"
        "import pdserve.deploy.up as up\n"
        "def fake_run_up(config, *args, **kw):\n"
        "    from ray.serve._private.handle_options import DynamicHandleOptions\n"
        "    print('by_reference', DynamicHandleOptions()._by_reference)\n"
        "    return 0\n"
        "up.run_up = fake_run_up\n"
        "sys.exit(cli.main(['up', '--model', sys.argv[1]]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(random_model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "by_reference False" in result.stdout, result.stdout + result.stderr


def test_up_passes_the_kv_memory_and_load_format_flags(
    random_model_dir: Path, tmp_path: Path
) -> None:
    """`--gpu-memory-utilization` and `--load-format` reach the engine config every worker
    builds; "dummy" serves a folder without weights (preflight does not ask for them)."""
    folder = tmp_path / "config-only"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(random_model_dir / name, folder / name)
    code = (
        "import sys\n"
        "from pdserve.deploy import cli\n"
        "import pdserve.deploy.up as up\n"
        "def fake_run_up(config, *args, **kw):\n"
        "    engine = config.engine_config()\n"
        "    print('engine', engine.gpu_memory_utilization, engine.load_format)\n"
        "    return 0\n"
        "up.run_up = fake_run_up\n"
        "sys.exit(cli.main(['up', '--model', *sys.argv[1:]]))\n"
    )
    flags = ["--gpu-memory-utilization", "0.7", "--load-format", "dummy"]
    result = subprocess.run(
        [sys.executable, "-c", code, str(folder), *flags],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "engine 0.7 dummy" in result.stdout, result.stdout + result.stderr
