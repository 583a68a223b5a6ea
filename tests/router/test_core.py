"""`RouterCore`'s request path with its workers and index as in-process fakes (fakes.py).

A real `RouterCore` (placement, conditional disaggregation, token channels, metrics)
talks to fake decode replicas (the real decode-side `Channels` under them), a fake
prefill handle and a fake prefix index, all in one event loop: no Ray, no Redis. Each
test plays the engine by scripting a request's output items, and checks what the router
sent to each worker, what the client got, the metrics and the router's reservations.
The cluster tests run the same paths on real workers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pdserve.cluster.config import ClusterConfig
from pdserve.common.sampling_params import SamplingParams
from pdserve.kv_transfer.errors import ChecksumMismatchError
from pdserve.router.core import Overloaded, Refused, RouterCore
from pdserve.router.metrics import LOCAL_PREFILL_REASONS, RouterMetrics
from tests.router.fakes import (
    TIMEOUT_S,
    FakeDecode,
    FakeHandle,
    FakeIndex,
    FakePrefill,
    Log,
    eventually,
    in_loop,
    output,
)

BLOCK = 16
PROMPT = list(range(5, 105))  # 100 tokens: 6 full blocks and a partial one
RATE = 1000  # prefill tokens per second the prefill worker's heartbeat publishes


class Cluster:
    """A RouterCore over fake decode replicas `decode_ids`, one fake prefill worker "p0"
    (listed in the index unless `prefill_live` is False) and a fake index, whose entries
    a test adjusts (`index.add`) before it sends its request."""

    def __init__(self, *decode_ids: str, prefill_live: bool = True, **fields: Any) -> None:
        self.log: Log = []
        self.decode = {w: FakeDecode(w, log=self.log) for w in decode_ids}
        self.handle = FakeHandle(*self.decode.values())
        self.prefill = FakePrefill("p0", log=self.log)
        self.index = FakeIndex()
        if prefill_live:
            self.index.add("p0", "prefill")
        for w in decode_ids:
            self.index.add(w, "decode")
        config = ClusterConfig(
            model="unused",
            max_model_len=512,
            block_size=BLOCK,
            first_token_timeout_s=TIMEOUT_S,
            stall_timeout_s=TIMEOUT_S,
            **fields,
        )
        # duck-typed stand-ins for the Serve handles and the Redis index client
        prefill: Any = self.prefill
        decode: Any = self.handle
        index: Any = self.index
        self.core = RouterCore(config, prefill, decode, index, metrics=RouterMetrics())

    def metric(self, name: str, **labels: str) -> float:
        """A sample of this model's series (each test's core has a registry of its own)."""
        m = self.core.metrics
        value = m.registry.get_sample_value(name, {"model": m.model, **labels})
        assert value is not None, f"no sample {name}{labels}"
        return value

    def local_prefills(self) -> dict[str, float]:
        """The non-zero local-prefill counts by reason."""
        counts = {
            reason: self.metric("pdserve_decode_local_prefill_total", reason=reason)
            for reason in LOCAL_PREFILL_REASONS
        }
        return {reason: n for reason, n in counts.items() if n}

    def decisions(self, where: str, reason: str) -> float:
        return self.metric("pdserve_disagg_decisions_total", where=where, reason=reason)

    def assert_nothing_held(self) -> None:
        """No request of this router counts as in flight or queued anywhere."""
        core = self.core
        assert not core.inflight_decode, core.inflight_decode
        assert not core.inflight_prefill_tokens, core.inflight_prefill_tokens
        assert not core.inflight_local_tokens, core.inflight_local_tokens

    def close(self) -> None:
        self.core.channels.close()


async def take(items: AsyncIterator[Any]) -> Any:
    async with asyncio.timeout(TIMEOUT_S):
        return await anext(items)


async def drain(items: AsyncIterator[Any]) -> list[Any]:
    async with asyncio.timeout(TIMEOUT_S):
        return [item async for item in items]


def tokens(items: list[dict[str, Any]]) -> list[int]:
    return [t for item in items for t in item["token_ids"]]


@in_loop
async def test_dispatch_asks_decode_first_then_prefill_pushes_to_its_receiver() -> None:
    """Behaviour 1: dual dispatch. D is submitted first; once it expects the KV, P is
    told to push to the address D answered with, skipping the blocks D holds; the
    outputs stream in order and P's report is counted before the client sees the end."""
    c = Cluster("d0", disagg_policy="always")
    d0 = c.decode["d0"]
    c.index.add("d0", "decode", matched_blocks=2)  # D holds the prompt's first 2 blocks
    d0.script["r1"] = [
        output(11, kv_used=True, num_prompt_tokens=len(PROMPT), num_cached_tokens=32),
        output(12),
        output(13, finished=True),
    ]
    params = SamplingParams(max_tokens=3)
    try:
        items = await drain(c.core.generate("r1", PROMPT, params, time.monotonic()))
    finally:
        c.close()

    assert tokens(items) == [11, 12, 13]
    assert [item["finished"] for item in items] == [False, False, True]
    assert c.log == [("submit", "d0", "r1"), ("prefill", "p0", "r1")]
    submit = d0.submits["r1"]
    assert submit["kv_expected"] is True
    assert submit["prompt_token_ids"] == PROMPT
    (call,) = c.prefill.calls
    assert call["request_id"] == "r1"
    assert call["prompt_token_ids"] == PROMPT
    assert call["params"] == params
    assert call["decode_address"] == d0.address
    assert call["first_block"] == 2
    assert call["target_replica"] == "p0"
    report = c.prefill.report(PROMPT)
    assert c.metric("pdserve_kv_transfer_blocks_total") == report["num_blocks_sent"]
    assert c.metric("pdserve_kv_transfer_bytes_total") == report["transfer_bytes"]
    assert c.metric("pdserve_prompt_tokens_total", pool="prefill") == len(PROMPT)
    assert c.metric("pdserve_placements_total", role="prefill", worker="p0") == 1
    assert c.metric("pdserve_placements_total", role="decode", worker="d0") == 1
    assert c.metric("pdserve_kv_transfer_failures_total") == 0
    assert c.decisions("remote", "always") == 1
    assert c.local_prefills() == {}, "D used the pushed KV: no local prefill"
    assert d0.aborted == [] and d0.kv_cancelled == []
    c.assert_nothing_held()


@pytest.mark.parametrize(
    ("prompt_len", "prefill_live", "decided", "counted"),
    [
        (20, True, "short_prompt", "policy"),  # 20 uncached tokens <= local_prefill_max_tokens
        (len(PROMPT), False, "no_prefill_worker", "no_prefill_worker"),
    ],
)
@in_loop
async def test_a_local_decision_calls_no_prefill_worker(
    prompt_len: int, prefill_live: bool, decided: str, counted: str
) -> None:
    """Behaviour 2: conditional disaggregation decides that D prefills: no prefill call,
    D is not asked to expect KV, the prompt's tokens count as D's queue until its first
    token, and the local prefill is counted with its reason."""
    c = Cluster("d0", prefill_live=prefill_live)
    d0 = c.decode["d0"]
    prompt = PROMPT[:prompt_len]
    d0.script["r1"] = [output(11, kv_used=False, local_prefill_s=0.01), output(12, True)]
    try:
        items = await c.core.start("r1", prompt, SamplingParams(max_tokens=2), 0.0)
        # admitted and placed, nothing sent yet: D's queue holds the prompt
        assert c.core.inflight_local_tokens == {"d0": prompt_len}
        assert d0.submitted == []
        got = await drain(items)
    finally:
        c.close()
    assert tokens(got) == [11, 12]
    assert c.prefill.calls == []
    submit = d0.submits["r1"]
    assert submit["kv_expected"] is False
    assert submit["prompt_token_ids"] == prompt
    assert submit["kv_wait_s"] is None
    assert d0.kv_cancelled == []
    assert c.decisions("local", decided) == 1
    assert c.local_prefills() == {counted: 1}
    assert c.metric("pdserve_kv_transfer_blocks_total") == 0
    c.assert_nothing_held()


@in_loop
async def test_a_stream_whose_decode_worker_dies_resumes_on_another() -> None:
    """Behaviour 3: d0's channel breaks after two tokens; the request goes on on d1 with
    the prompt plus those tokens (prefilled there, no KV asked for) and the tokens left,
    and the client sees every token once, in order."""
    c = Cluster("d0", "d1", disagg_policy="always")
    d0, d1 = c.decode["d0"], c.decode["d1"]
    c.index.add("d1", "decode", running=3)  # placement prefers the idle d0
    d0.script["r1"] = [output(11, kv_used=True), output(12)]
    d1.script["r1-resume1"] = [
        output(13, kv_used=False, local_prefill_s=0.01, num_prompt_tokens=len(PROMPT) + 2),
        output(14),
        output(15, finished=True),
    ]
    items = c.core.generate("r1", PROMPT, SamplingParams(max_tokens=5), time.monotonic())
    try:
        got = [await take(items), await take(items)]
        assert c.core.inflight_decode == {"d0": 1}
        d0.broken.set()  # the replica dies mid-stream
        got += await drain(items)
    finally:
        c.close()

    assert tokens(got) == [11, 12, 13, 14, 15]
    assert d0.submitted == ["r1"] and d1.submitted == ["r1-resume1"]
    resumed = d1.submits["r1-resume1"]
    assert resumed["prompt_token_ids"] == [*PROMPT, 11, 12]
    assert resumed["params"].max_tokens == 3
    assert resumed["kv_expected"] is False
    assert [call["request_id"] for call in c.prefill.calls] == ["r1"], "no prefill for a resume"
    assert c.metric("pdserve_decode_resumes_total") == 1
    assert c.decisions("local", "resume") == 1
    assert c.local_prefills() == {"resume": 1}
    assert c.metric("pdserve_placements_total", role="decode", worker="d1") == 1
    assert d1.aborted == []
    c.assert_nothing_held()


@pytest.mark.parametrize("invalid", [True, False], ids=["refused", "failed"])
@in_loop
async def test_a_request_the_engine_refuses_is_not_resumed(invalid: bool) -> None:
    """An error item marked `invalid` (the engine refused the request itself: say, its
    LoRA adapter was unloaded since the router looked) ends the request with `Refused`
    (a 400) and no resume; any other error item resumes it elsewhere."""
    c = Cluster("d0", "d1", disagg_policy="always")
    d0, d1 = c.decode["d0"], c.decode["d1"]
    c.index.add("d1", "decode", running=3)  # placement prefers the idle d0
    error = {"type": "error", "message": "no LoRA adapter 'a' is loaded"}
    d0.script["r1"] = [{**error, "invalid": True} if invalid else error]
    d1.script["r1-resume1"] = [output(13, kv_used=False, local_prefill_s=0.01), output(14, True)]
    items = c.core.generate("r1", PROMPT, SamplingParams(max_tokens=2), time.monotonic())
    try:
        if invalid:
            with pytest.raises(Refused, match="no LoRA adapter 'a' is loaded") as refused:
                await drain(items)
            assert refused.value.status_code == 400
        else:
            assert tokens(await drain(items)) == [13, 14]
    finally:
        c.close()
    assert d1.submitted == ([] if invalid else ["r1-resume1"])
    assert c.metric("pdserve_decode_resumes_total") == (0 if invalid else 1)
    c.assert_nothing_held()


@pytest.mark.parametrize("entry", ["start", "generate"])
@in_loop
async def test_a_client_that_closes_the_stream_stops_both_workers(entry: str) -> None:
    """Behaviour 4: the consumer closes the stream after the first token while P's call
    is still running: D gets `abort`, P's call is cancelled, nothing stays reserved.
    Through `start` (the HTTP path) and `generate`. The attempt's own cleanup has run
    when `aclose` returns (the nested generators are closed explicitly, not by the loop's
    finalizer a turn later, which left P running with its reservation already gone)."""
    c = Cluster("d0", disagg_policy="always")
    d0 = c.decode["d0"]
    c.prefill.hold = asyncio.Event()  # P's prefill never ends by itself
    # D streams a first token before the push arrived (its KV wait ended)
    d0.script["r1"] = [output(11, kv_used=False, local_prefill="kv_late")]
    params = SamplingParams(max_tokens=8)
    if entry == "start":
        items = await c.core.start("r1", PROMPT, params, time.monotonic())
    else:
        items = c.core.generate("r1", PROMPT, params, time.monotonic())
    try:
        assert tokens([await take(items)]) == [11]
        await eventually("P is called", lambda: bool(c.prefill.calls))
        assert c.core.inflight_prefill_tokens == {"p0": len(PROMPT)}
        assert c.core.inflight_decode == {"d0": 1}
        async with asyncio.timeout(TIMEOUT_S):
            await items.aclose()  # type: ignore[attr-defined]
        assert c.prefill.cancelled == ["r1"]  # before aclose returned
        c.assert_nothing_held()
        await eventually("D is told to abort", lambda: d0.aborted == ["r1"])
        await eventually("D's request ends", lambda: not d0.running)
    finally:
        c.close()
    c.assert_nothing_held()
    assert d0.kv_cancelled == [], "a client that left is no prefill failure"
    assert c.metric("pdserve_kv_transfer_failures_total") == 0
    assert c.metric("pdserve_decode_resumes_total") == 0


@in_loop
async def test_a_client_cancelled_before_its_first_token_stops_both_workers() -> None:
    """Behaviour 4, the other way a client leaves: the task reading the stream is
    cancelled while D waits for the KV that P is still computing."""
    c = Cluster("d0", disagg_policy="always")
    d0 = c.decode["d0"]
    c.prefill.hold = asyncio.Event()
    items = await c.core.start("r1", PROMPT, SamplingParams(max_tokens=8), time.monotonic())
    reader = asyncio.create_task(take(items))
    try:
        await eventually("P is called", lambda: bool(c.prefill.calls))
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert c.prefill.cancelled == ["r1"]
        c.assert_nothing_held()
        await eventually("D is told to abort", lambda: d0.aborted == ["r1"])
        await eventually("D's request ends", lambda: not d0.running)
    finally:
        c.close()
    assert d0.kv_cancelled == []


@in_loop
async def test_past_capacity_start_refuses_before_anything_reaches_a_worker() -> None:
    """Behaviour 5: every option's queue is past `max_prefill_queue_s` (4 s): `start`
    raises Overloaded with the excess of the shortest queue as its retry-after, and no
    worker was called, nor anything reserved. Once D's queue drains, it is admitted."""
    c = Cluster("d0")
    d0 = c.decode["d0"]
    # P: 9 s of prompts queued at 1000 tok/s; D: 10 s at the pool's rate
    c.index.add("p0", "prefill", queued_prefill_tokens=9 * RATE, prefill_tokens_per_s=RATE)
    c.index.add("d0", "decode", queued_prefill_tokens=10 * RATE)
    try:
        with pytest.raises(Overloaded, match="prefill capacity") as refused:
            async with asyncio.timeout(TIMEOUT_S):
                await c.core.start("r1", PROMPT, SamplingParams(), time.monotonic())
        assert refused.value.retry_after_s == 5  # the shortest queue, 9 s, less the 4 s bound
        assert c.handle.opened == 0 and d0.submitted == [] and c.prefill.calls == []
        assert c.log == []
        assert c.decisions("shed", "over_capacity") == 1
        c.assert_nothing_held()

        c.index.add("d0", "decode", queued_prefill_tokens=0)
        async with asyncio.timeout(TIMEOUT_S):
            items = await c.core.start("r2", PROMPT, SamplingParams(), time.monotonic())
        assert c.decisions("local", "faster") == 1  # D, idle, beats P's 9 s queue
        assert c.core.inflight_local_tokens == {"d0": len(PROMPT)}
        async with asyncio.timeout(TIMEOUT_S):
            await items.aclose()  # type: ignore[attr-defined]
    finally:
        c.close()
    assert c.log == [], "an admitted request that was closed before dispatch sent nothing"
    c.assert_nothing_held()


@in_loop
async def test_a_busy_prefill_worker_spills_to_a_streaming_decode_worker_within_budget() -> None:
    """`prefill_busy`: P has 1 s queued, D streams 4 sequences and would have the
    100-token prompt in 0.1 s: D prefills it, the decision and its predicted saving
    (1.1 s - 0.1 s) are counted, and D's spill budget (share 0.01: 0.1 s a window) is
    spent: the next prompt goes through the split."""
    c = Cluster("d0", decode_prefill_share=0.01)
    d0 = c.decode["d0"]
    c.index.add("p0", "prefill", queued_prefill_tokens=RATE, prefill_tokens_per_s=RATE)
    c.index.add("d0", "decode", running=4)
    d0.script["r1"] = [output(11, kv_used=False, local_prefill_s=0.1), output(12, True)]
    d0.script["r2"] = [output(21, kv_used=True), output(22, True)]
    try:
        got = await drain(c.core.generate("r1", PROMPT, SamplingParams(max_tokens=2), 0.0))
        assert tokens(got) == [11, 12]
        assert c.prefill.calls == [] and d0.submits["r1"]["kv_expected"] is False
        assert c.decisions("local", "prefill_busy") == 1
        assert c.local_prefills() == {"policy": 1}
        saved = c.metric("pdserve_disagg_saved_seconds_total", reason="prefill_busy")
        assert saved == pytest.approx(1.0, abs=0.01)
        got = await drain(c.core.generate("r2", PROMPT, SamplingParams(max_tokens=2), 0.0))
    finally:
        c.close()
    assert tokens(got) == [21, 22]
    assert [call["request_id"] for call in c.prefill.calls] == ["r2"]
    assert c.decisions("remote", "faster") == 1
    assert c.decisions("local", "prefill_busy") == 1
    c.assert_nothing_held()


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (RuntimeError("prefill worker died"), "prefill_failed"),
        (ChecksumMismatchError("bad block"), "transfer_failed"),
    ],
)
@in_loop
async def test_a_failed_prefill_frees_decode_to_prefill_at_once(
    error: BaseException, reason: str
) -> None:
    """P's call fails: the decode replica waiting for the KV is told (`cancel_kv`, with
    why), prefills itself, and the request is served; the failure is counted."""
    c = Cluster("d0", disagg_policy="always")
    d0 = c.decode["d0"]
    c.prefill.error = error
    items = c.core.generate("r1", PROMPT, SamplingParams(max_tokens=1), time.monotonic())
    reader = asyncio.create_task(drain(items))
    try:
        await eventually("D is told", lambda: bool(d0.kv_cancelled))
        assert d0.kv_cancelled == [("r1", reason)]
        assert [what for what, _, _ in c.log] == ["submit", "prefill", "cancel_kv"]
        d0.emit("r1", 11, finished=True, kv_used=False, local_prefill=reason)
        got = await reader
    finally:
        reader.cancel()
        c.close()
    assert tokens(got) == [11]
    assert c.metric("pdserve_kv_transfer_failures_total") == 1
    assert c.metric("pdserve_kv_transfer_blocks_total") == 0
    assert c.local_prefills() == {reason: 1}
    c.assert_nothing_held()
