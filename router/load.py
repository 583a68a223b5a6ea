"""A worker's load as this router sees it: the one place that reads it.

Two sources, merged here and nowhere else:

- the worker's own gauges (`IndexLoad`: running, waiting, queued prompt tokens, KV
  blocks), which it publishes each heartbeat and the index hands back with every match
  (`MatchResult.worker.load`);
- what this router has put there and not yet seen finish: prompt tokens sent to each
  prefill worker (`prefill_tokens`) or to be prefilled on a decode worker
  (`local_tokens`), and the streams open on each decode worker (`decode_streams`).

The gauges lag by up to a heartbeat and the router's own counts miss other routers'
requests, so each reading is the larger of the two. Placement (`router/placement.py`)
and admission (`router/core.py`) read load only through a `LoadBook`. How fast a worker
prefills is a rate, not load: `router/disagg.py`'s `RateBook` measures it.
"""

from __future__ import annotations

from collections import Counter

from pdserve.cluster.prefix_index import MatchResult
from pdserve.router.placement import decode_running, queued_tokens


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

    def prefill_queue(self, m: MatchResult) -> int:
        """Prompt tokens ahead of a new one on a prefill worker."""
        return queued_tokens(m, self.prefill_tokens)

    def local_queue(self, m: MatchResult) -> int:
        """Prompt tokens ahead of a new one prefilled on a decode worker."""
        return queued_tokens(m, self.local_tokens)

    def running(self, m: MatchResult) -> int:
        """Sequences on a decode worker."""
        return decode_running(m, self.decode_streams)

    def stream_opened(self, worker_id: str | None) -> None:
        if worker_id is not None:
            self.decode_streams[worker_id] += 1

    def stream_closed(self, worker_id: str | None) -> None:
        if worker_id is not None:
            _take(self.decode_streams, worker_id, 1)


def _take(counter: Counter[str], worker_id: str, amount: int) -> None:
    counter[worker_id] -= amount
    if counter[worker_id] <= 0:
        del counter[worker_id]
