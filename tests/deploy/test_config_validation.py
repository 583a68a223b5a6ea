"""A bad configuration fails fast, naming its field; `/health` tells the truth without Redis.

`pdserve up` runs as a user runs it (a subprocess): with an invalid configuration it must
exit non-zero within seconds, before any replica (or Ray, or Redis) starts, instead of
replicas crash-looping until the ready timeout. The Serve app builder runs the same
checks. `/health` with the index down asks the pools themselves (fake handles here).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from pdserve.cluster.config import ClusterConfig, ConfigError, redact_url
from pdserve.deploy.redis_server import EmbeddedRedis, free_port, wait_session_empty

FAIL_WITHIN_S = 10.0
PASSWORD = "not-for-the-logs-1234"


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    return Path(make_checkpoint(max_position_embeddings=256))


@pytest.fixture(scope="module")
def tls_flags(
    tmp_path_factory: pytest.TempPathFactory, kv_tls_flags: Callable[[Path], list[str]]
) -> list[str]:
    return kv_tls_flags(tmp_path_factory.mktemp("tls"))


def _up(model_dir: Path, *flags: str) -> tuple[int, str, float]:
    """Run `pdserve up` to its end; (exit code, stderr, wall seconds). Nothing it started
    may be left behind."""
    argv = [sys.executable, "-m", "pdserve.deploy.cli", "up", "--model", str(model_dir)]
    argv += ["--port", str(free_port()), *flags]
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)  # a hang fails here, not the suite
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall_s = time.monotonic() - start
    assert wait_session_empty(proc.pid, timeout_s=5) == [], "it left processes behind"
    assert "pdserve ready" not in out and "starting" not in err, err
    return proc.returncode, err, wall_s


@pytest.mark.cluster  # runs `pdserve up` (which exits before starting anything)
@pytest.mark.parametrize(
    ("field", "flags"),
    [
        ("block_size", ["--block-size", "12"]),
        ("max_model_len", ["--max-model-len", "4096"]),  # the model's is 256
        ("num_kv_blocks", ["--num-kv-blocks", "4", "--block-size", "16"]),  # 64 < 256 tokens
        ("gpu_memory_utilization", ["--gpu-memory-utilization", "1.5"]),
        ("replica_num_gpus", ["--device", "cuda"]),  # a replica asking no GPU sees none
        ("redis_url", ["--address", "127.0.0.1:1"]),  # other nodes cannot reach loopback
        ("kv_tls", ["--transport", "ucx", "TLS"]),
    ],
    ids=[
        "block-size",
        "max-model-len",
        "kv-pool",
        "gpu-memory-utilization",
        "cuda-without-gpus",
        "address-without-redis",
        "tls-with-ucx",
    ],
)
def test_up_rejects_a_bad_configuration_at_once(
    model_dir: Path, tls_flags: list[str], field: str, flags: list[str]
) -> None:
    flags = [f for flag in flags for f in (tls_flags if flag == "TLS" else [flag])]
    code, err, wall_s = _up(model_dir, *flags)
    assert code != 0, err
    assert wall_s < FAIL_WITHIN_S, f"took {wall_s:.1f}s"
    assert f"pdserve: error: {field}" in err, err
    assert "Traceback" not in err, err


@pytest.mark.cluster  # runs `pdserve up`
def test_up_rejects_an_unreachable_redis_without_printing_its_password(model_dir: Path) -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"  # nothing listens there
    code, err, wall_s = _up(model_dir, "--address", "127.0.0.1:1", "--redis-url", url)
    assert code != 0 and wall_s < FAIL_WITHIN_S, (code, wall_s, err)
    assert "pdserve: error: redis_url" in err, err
    assert PASSWORD not in err and "***" in err, err


@pytest.mark.cluster  # runs `pdserve up`
@pytest.mark.redis
def test_up_rejects_a_wrong_redis_password(model_dir: Path) -> None:
    with EmbeddedRedis(password=PASSWORD) as server:
        wrong = server.url.replace(PASSWORD, "wrong-password")
        code, err, wall_s = _up(model_dir, "--address", "127.0.0.1:1", "--redis-url", wrong)
    assert code != 0 and wall_s < FAIL_WITHIN_S, (code, wall_s, err)
    assert "pdserve: error: redis_url" in err and "wrong-password" not in err, err


def test_the_serve_app_builder_runs_the_same_checks(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.deploy.app import app_builder

    args: dict[str, Any] = {"model": str(model_dir), "redis_url": "redis://127.0.0.1:1/0"}
    with pytest.raises(ValueError, match="block_size"):
        app_builder({**args, "block_size": 12})
    with pytest.raises(ConfigError, match=r"^max_model_len: 4096 exceeds"):
        app_builder({**args, "max_model_len": 4096})
    with pytest.raises(ConfigError, match=r"^kv_tls: kv_tls cert file"):
        tls = {"cert_file": "/nonexistent.pem", "key_file": "k", "ca_file": "c"}
        app_builder({**args, "kv_tls": tls})
    monkeypatch.delenv("PDSERVE_REDIS_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match=r"^redis_url: names the environment variable"):
        app_builder({**args, "redis_url": "redis://:${PDSERVE_REDIS_PASSWORD}@h:6379/0"})


def test_dummy_weights_need_no_weight_files(model_dir: Path, tmp_path: Path) -> None:
    """A folder with config.json and tokenizer.json passes the checks and builds the app
    with load_format "dummy"; the KV settings reach every worker's engine config."""
    from pdserve.deploy.app import app_builder

    folder = tmp_path / "config-only"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_bytes((model_dir / name).read_bytes())
    args: dict[str, Any] = {
        "model": str(folder),
        "redis_url": "redis://127.0.0.1:1/0",
        "load_format": "dummy",
        "gpu_memory_utilization": 0.7,
    }
    config = ClusterConfig.from_serve_args(args).preflight()
    engine = config.engine_config()
    assert (engine.load_format, engine.gpu_memory_utilization) == ("dummy", 0.7)
    assert not any("safetensors" in p.name for p in folder.iterdir())
    app_builder(args)  # the Serve path runs the same checks, and passes
    # a CUDA worker measures its own pool: no 1 GiB rule against a long context there
    cuda = ClusterConfig(**{**args, "device": "cuda", "replica_num_gpus": 1, "max_num_seqs": 1})
    assert cuda.preflight().max_model_len == 256


def test_serve_args_read_secrets_from_the_environment(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", PASSWORD)
    monkeypatch.setenv("PDSERVE_API_KEYS", "sk-a, sk-b,")
    config = ClusterConfig.from_serve_args(
        {
            "model": str(model_dir),
            "redis_url": "redis://:${PDSERVE_REDIS_PASSWORD}@redis:6379/0",
            "api_keys": ["sk-config"],
        }
    )
    assert config.redis_url == f"redis://:{PASSWORD}@redis:6379/0"
    assert config.api_keys == ["sk-config", "sk-a", "sk-b"]
    assert PASSWORD not in repr(config) and "sk-a" not in repr(config)
    assert redact_url(config.redis_url) == "redis://:***@redis:6379/0"


def test_the_keys_file_gives_each_key_its_defaults(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.deploy.cli import _api_keys

    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    path = tmp_path / "keys"
    path.write_text("sk-gold priority=10 cache_salt=tenant-a\n\nsk-plain\n")
    keys, defaults = _api_keys(str(path))
    assert keys == ["sk-gold", "sk-plain"]
    config = ClusterConfig(model=str(model_dir), api_keys=keys, api_key_defaults=defaults)
    gold = config.api_key_defaults["sk-gold"]
    assert (gold.priority, gold.cache_salt) == (10, "tenant-a")
    assert "sk-gold" not in repr(config)
    path.write_text("sk-x colour=red\n")
    with pytest.raises(SystemExit, match="keys:1: expected KEY"):
        _api_keys(str(path))
    with pytest.raises(ValueError, match="api_key_defaults: 1 key"):
        ClusterConfig(model=str(model_dir), api_keys=["a"], api_key_defaults={"b": {}})


@pytest.mark.redis
def test_the_embedded_redis_requires_its_password() -> None:
    with EmbeddedRedis(password=PASSWORD) as server:
        assert PASSWORD in server.url
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host=server.host, port=server.port, socket_timeout=5).ping()
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        assert client.ping() is True
        client.close()


# --- /health when the index is unreachable ---------------------------------------------


class _Pool:
    """A Serve handle's `load.remote()`: answers, fails, or never answers."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.load = SimpleNamespace(remote=self._remote)

    async def _remote(self, **_: Any) -> dict[str, Any]:
        if self.behaviour == "fails":
            raise RuntimeError("no replica")
        if self.behaviour == "hangs":
            await asyncio.Event().wait()
        return {"running": 0}


@pytest.mark.parametrize(
    ("decode", "prefill", "status", "code"),
    [
        ("answers", "answers", "degraded", 200),
        ("answers", "hangs", "unavailable", 503),
        ("fails", "answers", "unavailable", 503),
        ("answers", None, "degraded", 200),  # colocated: no prefill pool
    ],
)
def test_health_without_the_index_asks_every_pool(
    monkeypatch: pytest.MonkeyPatch, decode: str, prefill: str | None, status: str, code: int
) -> None:
    from pdserve.router import app

    monkeypatch.setattr(app, "POOL_HEALTH_TIMEOUT_S", 0.2)
    core = SimpleNamespace(
        decode=_Pool(decode),
        prefill=None if prefill is None else _Pool(prefill),
        config=SimpleNamespace(mode="disagg" if prefill else "colocated"),
    )

    async def ask() -> Any:
        return await asyncio.wait_for(app.pools_health(core, "ConnectionError()"), 5)  # type: ignore[arg-type]

    response = asyncio.run(ask())
    body = json.loads(response.body)
    assert (response.status_code, body["status"]) == (code, status), body
    expected = {"decode": decode == "answers"} | (
        {} if prefill is None else {"prefill": prefill == "answers"}
    )
    assert {role: state == "ok" for role, state in body["pools"].items()} == expected


def test_the_triton_backend_off_cuda_needs_the_interpreter(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without TRITON_INTERPRET, Triton's kernels cannot launch on a CPU: the cluster
    refuses at once, naming the field, and so does the engine (not at a replica's first
    kernel launch, with the kernel's own error)."""
    from pdserve.engine import LLM

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = ClusterConfig(model=str(model_dir), attention_backend="triton", device="cpu")
    with pytest.raises(ConfigError, match=r"attention_backend: triton off CUDA.*TRITON_INTERPRET"):
        config.preflight()
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(model_dir, attention_backend="triton", dtype="float32", num_kv_blocks=16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config.preflight()  # the interpreter: allowed
