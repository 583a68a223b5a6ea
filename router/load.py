"""A worker's load as this router sees it: the one place that reads it.

Two sources, merged here and nowhere else:

- the worker's own gauges (`IndexLoad`: running, waiting, queued prompt tokens, KV
  blocks), which it publishes each heartbeat and the index hands back with every match
  (`MatchResult.worker.load`);
- what this router has put there and not yet seen finish: prompt tokens sent to each
  prefill worker (`prefill_tokens`) or to be prefilled on a decode worker
  (`local_tokens`), and the streams open on each decode worker (`decode_streams`), with
  their LoRA adapters (`lora_streams`: a worker running a stream of an adapter holds it,
  whatever its last heartbeat said, and still does for `RECENT_S` after the stream ends,
  until a heartbeat has had time to say so).

The gauges lag by up to a heartbeat and the router's own counts miss other routers'
requests, so each reading is the larger of the two. Placement (`router/placement.py`)
and admission (`router/core.py`) read load only through a `LoadBook`. How fast a worker
prefills is a rate, not load: `router/disagg.py`'s `RateBook` measures it.
"""

from __future__ import annotations

import time
from collections import Counter

from pdserve.cluster.prefix_index import MatchResult
from pdserve.common.hashing import LORA_GAUGE_PREFIX
from pdserve.router.placement import decode_running, queued_tokens

RECENT_S = 3.0  # a few heartbeats (heartbeat_s 1 s by default)


class Hold:
    """One reservation in a counter of a `LoadBook`, given back once by `release`."""

    def __init__(self, counter: Counter[str], worker_id: str, amount: int) -> None:
        self._counter = counter
        self.worker_id = worker_id
        self.amount = amount
        counter[worker_id] += amount

    def release(self) -> None:
        """Give the reservation back; idempotent."""
        if self.amount:
            _take(self._counter, self.worker_id, self.amount)
            self.amount = 0


class LoadBook:
    """This router's in-flight counts per worker, and each worker's merged load."""

    def __init__(self) -> None:
        self.prefill_tokens: Counter[str] = Counter()
        self.local_tokens: Counter[str] = Counter()
        self.decode_streams: Counter[str] = Counter()
        self.lora_streams: Counter[tuple[str, str]] = Counter()  # (worker, adapter)
        self._lora_closed: dict[tuple[str, str], float] = {}  # when its last stream ended

    def prefill_queue(self, m: MatchResult) -> int:
        """Prompt tokens ahead of a new one on a prefill worker."""
        return queued_tokens(m, self.prefill_tokens)

    def local_queue(self, m: MatchResult) -> int:
        """Prompt tokens ahead of a new one prefilled on a decode worker."""
        return queued_tokens(m, self.local_tokens)

    def running(self, m: MatchResult) -> int:
        """Sequences on a decode worker."""
        return decode_running(m, self.decode_streams)

    def holds_lora(self, m: MatchResult, lora: str) -> bool:
        """Whether the worker has adapter `lora` resident: its heartbeat says so, or this
        router has a stream of it there."""
        key = (m.worker.worker_id, lora)
        if m.worker.load.get(LORA_GAUGE_PREFIX + lora, 0) > 0 or self.lora_streams[key] > 0:
            return True
        closed = self._lora_closed.get(key)
        return closed is not None and time.monotonic() - closed < RECENT_S

    def stream_opened(self, worker_id: str | None, lora: str | None = None) -> None:
        if worker_id is not None:
            self.decode_streams[worker_id] += 1
            if lora is not None:
                self.lora_streams[(worker_id, lora)] += 1

    def stream_closed(self, worker_id: str | None, lora: str | None = None) -> None:
        if worker_id is not None:
            _take(self.decode_streams, worker_id, 1)
            if lora is not None:
                key = (worker_id, lora)
                self.lora_streams[key] -= 1
                if self.lora_streams[key] <= 0:
                    del self.lora_streams[key]
                    now = time.monotonic()
                    self._lora_closed[key] = now
                    if len(self._lora_closed) > 4 * len(self.lora_streams) + 64:
                        self._lora_closed = {
                            k: t for k, t in self._lora_closed.items() if now - t < RECENT_S
                        }


def _take(counter: Counter[str], worker_id: str, amount: int) -> None:
    counter[worker_id] -= amount
    if counter[worker_id] <= 0:
        del counter[worker_id]
