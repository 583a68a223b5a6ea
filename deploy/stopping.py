"""How `pdserve up` reacts to Ctrl-C and SIGTERM: every stop stops.

The first SIGINT or SIGTERM asks for a graceful stop: `run_up` drains the streams (they
finish, or end with an error event after `shutdown_grace_s`), deletes the application,
stops Ray, then Redis, all within `budget_s` of the signal. A second signal, or the end
of the budget, kills every process `pdserve up` started and exits at once.

A Python signal handler runs only when the main thread next executes Python code, which
it may not do for a long while (a blocking call into Ray, a C extension). So the signals
are counted by a thread of their own: the handler is installed for both signals, and its
C half writes each signal's number to a pipe (`signal.set_wakeup_fd`) as soon as the
signal arrives, whatever the main thread does; the thread reads that pipe. The Python
half only sets the stop flag, and, while the main thread is in a step that cannot
watch it (training the demo model, starting Ray), raises `StartAborted` there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

# From the first signal to the process's exit: a longer `shutdown_grace_s` than the
# default 10 s raises it by as much (`stop_budget_s`). With the default, the budget stays
# inside Kubernetes' default 30 s termination grace.
STOP_MARGIN_S = 17.0  # beyond the streams' grace: the routers' drain, Serve, Ray, Redis
STOP_BUDGET_S = 10.0 + STOP_MARGIN_S


def stop_budget_s(shutdown_grace_s: float) -> float:
    return max(STOP_BUDGET_S, shutdown_grace_s + STOP_MARGIN_S)


SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StartAborted(KeyboardInterrupt):
    """Stopped (Ctrl-C / SIGTERM) before the cluster was ready. A KeyboardInterrupt, so
    that no `except Exception` in the step it interrupts takes it for that step's error."""


def _ppid_map() -> dict[int, int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while we looked
            continue
        # Fields after the parenthesised command: state ppid ...
        fields = text.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    return parents


def descendants(pid: int | None = None) -> list[int]:
    """Every live process below `pid` (default: this one): Ray's daemons and workers, the
    embedded Redis, tensor-parallel ranks."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for child, parent in _ppid_map().items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:80] or "?"


def kill_descendants() -> list[str]:
    """SIGKILL every process below this one, all at once (listed first, so none escapes
    by being re-parented while the others die); return what was killed."""
    pids = descendants()
    killed = [f"{pid} {_command(pid)}" for pid in pids]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return killed


def become_subreaper() -> None:
    """Processes orphaned below this one (Ray's workers, once their raylet is gone) are
    re-parented to it rather than to init, so `descendants` still finds them (prctl)."""
    import ctypes

    pr_set_child_subreaper = 36
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1)


def _reap() -> None:
    """Collect exited children (orphans re-parented here included)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


def finish(timeout_s: float = 5.0) -> list[str]:
    """Once everything was stopped: wait (bounded) for the processes still exiting, then
    kill any left; return what had to be killed."""
    deadline = time.monotonic() + timeout_s
    while True:
        _reap()
        if not descendants() or time.monotonic() >= deadline:
            break
        time.sleep(0.1)  # exiting processes: nothing to wait on but their absence
    killed = kill_descendants()
    _reap()
    return killed


class StopSignals:
    """SIGINT / SIGTERM handling of `pdserve up` (module docstring).

    Args:
        say: Prints a line for the user (stderr).
        budget_s: How long a graceful stop may take from the first signal.
    """

    def __init__(self, say: Callable[[str], None], budget_s: float = STOP_BUDGET_S) -> None:
        self.say = say
        self.budget_s = budget_s
        self.stop = threading.Event()
        self.first_signal_s: float | None = None
        self._count = 0
        self._interruptible = 0
        self._lock = threading.Lock()
        self._wakeup_w: int | None = None

    @property
    def deadline_s(self) -> float | None:
        """time.monotonic() by which the graceful stop must be done (None: no signal yet)."""
        return None if self.first_signal_s is None else self.first_signal_s + self.budget_s

    def install(self) -> StopSignals:
        """Install the handlers and the signal thread (main thread only)."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._wakeup_w = write_fd
        self.reinstall()
        threading.Thread(
            target=self._watch, args=(read_fd,), name="pdserve-signals", daemon=True
        ).start()
        return self

    def reinstall(self) -> None:
        """Install them again: `ray.init` replaces the SIGTERM handler of its driver."""
        assert self._wakeup_w is not None
        signal.set_wakeup_fd(self._wakeup_w, warn_on_full_buffer=False)
        for sig in SIGNALS:
            signal.signal(sig, self._handler)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A step that does not watch `stop` itself: a signal raises StartAborted in it."""
        if self.stop.is_set():
            raise StartAborted("stopped before the cluster was ready")
        self._interruptible += 1
        try:
            yield
        finally:
            self._interruptible -= 1

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # The signal thread has it too (the wakeup pipe), and sets `stop`.
        if self._interruptible:
            raise StartAborted("stopped before the cluster was ready")

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in SIGNALS:
                    self._on_signal(signal.Signals(signum))

    def _on_signal(self, sig: signal.Signals) -> None:
        with self._lock:
            self._count += 1
            first = self._count == 1
            if first:
                self.first_signal_s = time.monotonic()
        if first:
            again = "Ctrl-C" if sig == signal.SIGINT else sig.name
            self.say(
                f"{sig.name}: stopping (streams end within their grace, everything within "
                f"{self.budget_s:g} s; {again} again stops at once)"
            )
            self.stop.set()
            timer = threading.Timer(self.budget_s, self._out_of_time)
            timer.daemon = True
            timer.start()
        else:
            self.say(f"{sig.name} again: killing everything pdserve up started")
            self._kill_and_exit(130)

    def _out_of_time(self) -> None:
        self.say(f"the stop took longer than {self.budget_s:g} s: killing what is left")
        self._kill_and_exit(1)

    def _kill_and_exit(self, code: int) -> None:
        killed = kill_descendants()
        if killed:
            self.say(f"killed {len(killed)} processes: " + "; ".join(killed))
        self.say("stopped")
        sys.stderr.flush()
        os._exit(code)
