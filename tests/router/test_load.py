"""A worker's load as the router reads it (router/load.py): heartbeat gauges merged with
what this router has in flight there."""

from __future__ import annotations

from collections import Counter

import pytest

from pdserve.cluster.prefix_index import MatchResult, WorkerInfo
from pdserve.router import load as load_module
from pdserve.router.load import Hold, LoadBook


def match(worker_id: str, role: str, **load: int) -> MatchResult:
    return MatchResult(WorkerInfo(worker_id, role, f"{worker_id}:1", 1, load), 0)


def test_each_reading_is_the_larger_of_the_gauge_and_the_routers_own_count() -> None:
    book = LoadBook()
    p = match("p", "prefill", queued_prefill_tokens=300)
    d = match("d", "decode", running=2, waiting=1, queued_prefill_tokens=0)
    assert (book.prefill_queue(p), book.local_queue(d), book.running(d)) == (300, 0, 3)
    book.prefill_tokens["p"] = 500  # sent since the last heartbeat
    book.local_tokens["d"] = 64
    for _ in range(5):
        book.stream_opened("d")
    assert (book.prefill_queue(p), book.local_queue(d), book.running(d)) == (500, 64, 5)
    for _ in range(5):
        book.stream_closed("d")
    book.stream_opened(None)  # a stream Serve placed itself: nothing to count
    assert not book.decode_streams
    assert book.running(d) == 3


def test_a_hold_is_given_back_once() -> None:
    counter: Counter[str] = Counter({"p": 10})
    hold = Hold(counter, "p", 90)
    other = Hold(counter, "p", 5)
    assert counter["p"] == 105
    hold.release()
    hold.release()
    assert counter == Counter({"p": 15})
    other.release()
    assert counter == Counter({"p": 10})
    Hold(counter, "q", 7).release()
    assert "q" not in counter


def test_a_worker_holds_an_adapter_by_its_heartbeat_its_streams_or_a_stream_just_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(load_module.time, "monotonic", lambda: now[0])
    book = LoadBook()
    d = match("d", "decode", **{"lora:x": 1, "lora:y": 0})
    assert book.holds_lora(d, "x") and not book.holds_lora(d, "y")
    book.stream_opened("d", "y")  # the heartbeat has not seen it yet
    assert book.holds_lora(d, "y") and not book.holds_lora(match("e", "decode"), "y")
    book.stream_closed("d", "y")
    assert not book.lora_streams and book.holds_lora(d, "y")  # until a heartbeat says
    now[0] += load_module.RECENT_S
    assert not book.holds_lora(d, "y")
