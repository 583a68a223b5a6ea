"""`pdserve bench --priority-mix`'s parts: the mix, the priorities drawn, the per-priority
report. Plain Python; the flood itself runs against a cluster (README's figures)."""

from __future__ import annotations

import pytest

from pdserve.benchmarks.bench_client import RequestRecord, request_body
from pdserve.benchmarks.bench_workloads import ModelInfo, SharedPrefix
from pdserve.benchmarks.priority_mix import (
    PriorityMix,
    parse_mix,
    render,
    shed_above_admitted,
    summarize_by_priority,
    ttft_ratio,
)


def test_parse_mix() -> None:
    assert parse_mix("0:0.8,10:0.2") == [(0, 0.8), (10, 0.2)]
    assert parse_mix("-5:1") == [(-5, 1.0)]
    for bad in ("", "0", "0:x", "a:1", "0:0", "0:-1", "0:1,0:2"):
        with pytest.raises(ValueError, match="priority-mix"):
            parse_mix(bad)


def test_each_request_carries_a_drawn_priority() -> None:
    mix = PriorityMix(SharedPrefix(output_len=4), ((0, 0.8), (10, 0.2)), seed=3)
    model = ModelInfo("m", 512, 2048)
    specs = [spec for spec, _ in zip(mix.requests(model, 0), range(2000), strict=False)]
    assert [s.priority for s in specs] == [mix.priority_of(s.index) for s in specs]
    share = sum(s.priority == 10 for s in specs) / len(specs)
    assert 0.17 < share < 0.23  # 0.2 within ~3.4 sigma of 2000 draws
    assert request_body("m", specs[0])["priority"] == specs[0].priority
    assert "priority" not in request_body("m", SharedPrefix().requests(model, 0).__next__())


def _record(index: int, ttft_s: float | None, reason: str = "") -> RequestRecord:
    return RequestRecord(index, "", 0.0, 8, 4, ttft_s=ttft_s, success=not reason, reason=reason)


def test_report_by_priority() -> None:
    records = [
        _record(0, 0.1),
        _record(1, 0.3),
        _record(2, None, "http_429"),
        _record(3, 1.0),
        _record(4, None, "first_token_timeout"),
    ]
    priority_of = {0: 10, 1: 10, 2: 0, 3: 0, 4: 0}
    low, high = summarize_by_priority(records, priority_of)
    assert (low.priority, low.sent, low.shed, low.completed, low.failed) == (0, 3, 1, 1, 1)
    assert (high.sent, high.shed, high.completed) == (2, 0, 2)
    assert high.ttft.p50 == pytest.approx(0.2)
    assert ttft_ratio([low, high]) == pytest.approx(0.2)
    assert shed_above_admitted(records, priority_of) == 0
    # a 10 refused while a 0 got in counts; a 0 refused while a 10 got in does not
    refused_high = [*records, _record(5, None, "http_429")]
    assert shed_above_admitted(refused_high, {**priority_of, 5: 10}) == 1
    assert "higher shed while lower admitted: 0" in render([low, high], 0, 0.2)
