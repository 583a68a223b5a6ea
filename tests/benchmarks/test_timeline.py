"""Timelines (common/timeline.py) as the engine and the router write them, and their
summary (benchmarks/timeline.py): every prompt token is in some step's chunk, every
request's stages are on the router's timeline, and the summary adds them up."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pdserve.benchmarks import timeline as summary
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.timeline import ENV
from pdserve.engine import LLM
from tests.router.fakes import in_loop, output
from tests.router.test_core import PROMPT, RATE, Cluster, drain


def events(folder: Path, kind: str) -> list[dict]:
    (path,) = folder.glob(f"{kind}-*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_engines_steps_hold_every_prompt_token_in_chunks(
    random_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    prompts = [[7 + i] * n for i, n in enumerate((5, 40, 70))]
    llm = LLM(random_model_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    llm.close()
    got = events(tmp_path, "engine")
    assert got[0]["ev"] == "start" and got[0]["kind"] == "engine"
    steps = [e for e in got if e["ev"] == "step"]
    adds = {e["rid"]: e["prompt"] for e in got if e["ev"] == "add"}
    firsts = [e["rid"] for e in got if e["ev"] == "first"]
    assert sorted(adds.values()) == [5, 40, 70]
    assert sorted(firsts) == sorted(adds) == sorted(o.request_id for o in outs)
    for rid, n in adds.items():  # the chunks of each prompt tile it, in order
        chunks = [(start, k) for s in steps for r, start, k in s["prefill"] if r == rid]
        assert [start for start, _ in chunks] == [
            sum(k for _, k in chunks[:i]) for i in range(len(chunks))
        ]
        assert sum(k for _, k in chunks) == n
    assert all(sum(k for _, _, k in s["prefill"]) + s["decode"] <= 32 for s in steps)
    decode_rows = sum(s["decode"] for s in steps)
    assert decode_rows == 3 * (4 - 1)  # every token after the first is a decode row
    e = summary.summarize(tmp_path)["engines"]
    (one,) = e.values()
    assert one["steps"] == len(steps)
    assert one["chunks per prompt p50"] == 2  # 5 -> 1, 40 -> 2, 70 -> 3 at 32 a step


@in_loop
async def test_the_router_writes_each_requests_stages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    c = Cluster("d0", disagg_policy="always")
    c.decode["d0"].script["r1"] = [output(11, kv_used=True), output(12), output(13, True)]
    arrival = time.monotonic()
    try:
        await drain(c.core.generate("r1", PROMPT, SamplingParams(max_tokens=3), arrival))
    finally:
        c.close()
    got = {e["ev"]: e for e in events(tmp_path, "router")}
    assert got.keys() == {"start", "dispatch", "prefill", "first", "done"}
    d = got["dispatch"]
    assert (d["rid"], d["prefill"], d["decode"], d["where"]) == ("r1", "p0", "d0", "remote")
    assert (d["reason"], d["saved_s"]) == ("always", 0.0)
    assert d["arrival"] <= d["t"] <= got["first"]["t"] <= got["done"]["t"]
    assert got["first"]["kv_used"] is True and got["done"]["tokens"] == 3
    r = summary.summarize(tmp_path)["requests"]
    assert r["requests"] == 1 and r["where"] == {"remote": 1}
    assert r["decisions"] == {"remote/always": {"requests": 1, "saved_s": 0.0}}
    assert {"ttft", "router", "tpot", "prefill queue", "prefill compute", "KV push"} <= r[
        "ms"
    ].keys()


@in_loop
async def test_the_summary_counts_each_decision_and_its_predicted_saving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt spilled from a busy prefill worker (`prefill_busy`, as in test_core's
    spill test: P's 1 s queue against D's 0.1 s) is on the timeline with its reason and
    the 1 s it was predicted to save, and the summary adds it up."""
    monkeypatch.setenv(ENV, str(tmp_path))
    c = Cluster("d0", decode_prefill_share=0.01)
    c.index.add("p0", "prefill", queued_prefill_tokens=RATE, prefill_tokens_per_s=RATE)
    c.index.add("d0", "decode", running=4)
    c.decode["d0"].script["r1"] = [output(11, kv_used=False, local_prefill_s=0.1), output(12, True)]
    try:
        await drain(c.core.generate("r1", PROMPT, SamplingParams(max_tokens=2), time.monotonic()))
    finally:
        c.close()
    (d,) = [e for e in events(tmp_path, "router") if e["ev"] == "dispatch"]
    assert (d["where"], d["reason"]) == ("local", "prefill_busy")
    assert d["saved_s"] == pytest.approx(1.0, abs=0.01)
    r = summary.summarize(tmp_path)["requests"]
    assert r["where"] == {"local": 1}
    (key,) = r["decisions"]
    assert key == "local/prefill_busy" and r["decisions"][key]["requests"] == 1
    assert r["decisions"][key]["saved_s"] == pytest.approx(1.0, abs=0.01)
