"""`pdserve up` as a user runs it: a real subprocess with a real Ray cluster and Redis.

`start_cluster(...)` runs the CLI, reads its stdout until `pdserve ready at URL`, and on
exit sends SIGTERM and checks that it stops within its drain deadline.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from pdserve.deploy.redis_server import free_port

START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 90.0


def _read_until_ready(proc: subprocess.Popen[str], log: list[str]) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while (remaining := deadline - time.monotonic()) > 0:
            if not selector.select(remaining):
                break
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"pdserve up exited with {proc.wait(10)}:\n{''.join(log)}")
            log.append(line)
            if line.startswith("pdserve ready at "):
                return line.split("pdserve ready at ", 1)[1].strip()
    raise TimeoutError(f"pdserve up not ready within {START_TIMEOUT_S}s:\n{''.join(log)}")


@contextlib.contextmanager
def start_cluster(model_dir: Path, *args: str) -> Iterator[str]:
    """Run `pdserve up --model model_dir ARGS` on a free port; yield its base URL."""
    argv = [sys.executable, "-m", "pdserve.deploy.cli", "up", "--model", str(model_dir)]
    argv += ["--port", str(free_port()), *args]
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1"}
    # stderr (Ray's and the replicas' logs) goes to ours, so a failure shows it.
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    log: list[str] = []
    try:
        yield _read_until_ready(proc, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError("pdserve up did not stop within its deadline") from None
        assert code == 0, f"pdserve up exited with {code}"
        left = _wait_session_empty(proc.pid)
        assert not left, f"pdserve up left processes behind: {left}"


def _session_members(sid: int) -> list[str]:
    """Processes of a session (ours started `pdserve up` in a new one), by /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while we looked
            continue
        # Fields after the parenthesised command: state ppid pgrp session ...
        fields = text.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(text.split(")", 1)[0] + ")")
    return members


def _wait_session_empty(sid: int, timeout_s: float = 15.0) -> list[str]:
    """A bounded wait: children may finish exiting just after their parent."""
    deadline = time.monotonic() + timeout_s
    while (left := _session_members(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="session")
def pdserve_up() -> Callable[..., AbstractContextManager[str]]:
    """`with pdserve_up(model_dir, *flags) as url:` runs `pdserve up` for the block."""
    return start_cluster
