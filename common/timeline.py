"""Timelines of requests and engine steps, written as JSON lines for reading where each
request's time goes under load (`benchmarks/timeline.py` summarizes a folder of them).

Off unless `PDSERVE_TIMELINE_DIR` names a folder. Then every process that records
(each router replica, each engine) appends to a file of its own there,
`<kind>-<pid>.jsonl`, one JSON object a line, each with `t`: wall-clock seconds (the
processes of one machine share the clock; across machines, as well as their clocks
agree). The router writes a request's stages (`router/core.py`): arrival, placement
and dispatch, the prefill worker's report, first token, end. An engine writes each
step (`engine/llm_engine.py`): its start, duration, the prefill chunks and the decode
and verify rows it ran, and the queue it left; and each request's arrival in the
engine and its first token. Meant for a benchmark run, not for always-on production
use: it costs a line per step and per stage.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, TextIO

ENV = "PDSERVE_TIMELINE_DIR"


class Timeline:
    """One process's timeline file; thread-safe, line-buffered, append-only."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: TextIO | None = path.open("a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, kind: str, **header: Any) -> Timeline | None:
        """This process's timeline of `kind` ("router", "engine"), when the environment
        asks for one; its first line says who writes it (`header`)."""
        folder = os.environ.get(ENV, "").strip()
        if not folder:
            return None
        timeline = cls(Path(folder) / f"{kind}-{os.getpid()}-{threading.get_ident()}.jsonl")
        timeline.write("start", kind=kind, pid=os.getpid(), **header)
        return timeline

    def write(self, event: str, t: float | None = None, **fields: Any) -> None:
        line = json.dumps({"ev": event, "t": time.time() if t is None else t, **fields})
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def wall_of(monotonic_s: float) -> float:
    """The wall-clock time of a `time.monotonic()` reading taken in this process."""
    return time.time() - (time.monotonic() - monotonic_s)
