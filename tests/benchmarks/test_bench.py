"""`pdserve bench` against a real `pdserve up` (demo model) and against misbehaving servers.

The cluster tests run every workload once on one cluster and check that the report's
numbers are the requests sent: counts, successes, prompt and output token totals (the
server's own usage and /metrics deltas must agree), and that the files are written; the
cluster is disaggregated, and every test ends with no prompt prefilled on decode. The
client-deadline tests use a small HTTP server on a real socket that streams a few SSE
chunks and then goes silent, and check that the benchmark gives up within its deadline
and closes the connection (the server sees it go away).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.benchmarks import compare
from pdserve.benchmarks.bench import (
    BenchResult,
    ClientLimits,
    ModelInfo,
    Poisson,
    TraceTimes,
    run_benchmark,
    write_outputs,
)
from pdserve.benchmarks.bench_report import parse_scrape
from pdserve.benchmarks.bench_workloads import (
    Mixed,
    SharedPrefix,
    ShareGPTLike,
    Trace,
    Workload,
    load_trace,
)
from pdserve.benchmarks.machine import cpu_line, machine
from pdserve.common.tokenizer import Tokenizer
from pdserve.deploy.cli import main as cli_main

NUM_REQUESTS = 12
RATE = 50.0  # req/s: all 12 within a fraction of a second
DEMO_VOCAB, DEMO_CONTEXT = 512, 2048
CLUSTER_FLAGS = ("--prefill-replicas", "1", "--decode-replicas", "1", "--replica-cpus", "0")
TRACE = [
    {"timestamp": 100.0, "prompt_token_ids": [7, 8, 9, 10, 11], "output_len": 3},
    {"timestamp": 100.02, "prompt": "The river runs", "output_len": 2},
    {"timestamp": 100.05, "prompt_token_ids": list(range(20, 45)), "output_len": 5},
    {"timestamp": 100.05, "prompt": "Hello there", "output_len": 1},
]


@pytest.fixture(scope="module")
def cluster_url(demo_model_dir: Path, pdserve_up: Any) -> Iterator[str]:
    with pdserve_up(demo_model_dir, *CLUSTER_FLAGS) as url:
        yield url


def read_json(out_dir: Path) -> dict[str, Any]:
    for name in ("bench.json", "bench.md", "ttft_cdf.png", "tpot_cdf.png"):
        assert (out_dir / name).stat().st_size > 0, name
    assert (out_dir / "ttft_cdf.png").read_bytes().startswith(b"\x89PNG")
    return json.loads((out_dir / "bench.json").read_text())


def check_run(run: dict[str, Any], want: list[tuple[int, int]]) -> None:
    """`want`: (prompt tokens, output tokens) of each request sent, in order."""
    summary, requests = run["summary"], sorted(run["requests"], key=lambda r: r["index"])
    assert summary["num_requests"] == len(requests) == len(want)
    assert summary["num_succeeded"] == len(want), summary["failures"]
    assert summary["failures"] == {}
    got = [(r["prompt_tokens"], r["output_tokens"]) for r in requests]
    assert got == want
    assert [r["output_len"] for r in requests] == [out for _, out in want]
    assert summary["prompt_tokens"] == sum(p for p, _ in want)
    assert summary["output_tokens"] == sum(o for _, o in want)
    for r in requests:
        assert r["success"] and r["reason"] == ""
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert len(r["itl_s"]) <= r["output_tokens"] - 1
    assert summary["ttft_s"]["count"] == len(want)
    assert summary["request_throughput"] == pytest.approx(len(want) / summary["duration_s"])
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])  # no SLO given
    server = summary["server"]
    assert server is not None, "pdserve has /metrics"
    # Every request's prompt reaches the decode pool exactly once (disaggregated or not).
    assert server["prompt_tokens"]["decode"] == summary["prompt_tokens"]
    assert server["ttft_stage_count"]["decode_queue"] == len(want)
    for rate in server["prefix_hit_rate"].values():
        assert rate is None or 0.0 <= rate <= 1.0


def bench(url: str, workload: Workload, arrival: Any, out_dir: Path, **kw: Any) -> BenchResult:
    result = asyncio.run(run_benchmark(url, workload, arrival, progress=False, **kw))
    write_outputs([result], out_dir, config={"test": True})
    return result


@pytest.mark.parametrize(
    ("workload", "check"),
    [
        (
            SharedPrefix(num_prefixes=2, prefix_len=32, suffix_len=8, output_len=4),
            lambda reqs: [(40, 4)] * NUM_REQUESTS,
        ),
        (
            Mixed(
                0.5, long_prompt_len=48, short_output_len=2, short_prompt_len=8, long_output_len=6
            ),
            lambda reqs: [(48, 2) if r["kind"] == "long-prompt" else (8, 6) for r in reqs],
        ),
        (
            ShareGPTLike(prompt_len=16, output_len=4, sigma=0.5),
            lambda reqs: [(r["prompt_len"], r["output_len"]) for r in reqs],
        ),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_synthetic_workload_reports_what_it_sent(
    api: Any, cluster_url: str, tmp_path: Path, workload: Workload, check: Any
) -> None:
    bench(cluster_url, workload, Poisson(RATE, seed=3), tmp_path, num_requests=NUM_REQUESTS)
    (run,) = read_json(tmp_path)["runs"]
    requests = sorted(run["requests"], key=lambda r: r["index"])
    assert run["model"]["max_model_len"] == DEMO_CONTEXT  # read from pdserve's model card
    check_run(run, check(requests))
    for r in requests:
        assert r["prompt_len"] + r["output_len"] <= DEMO_CONTEXT
    if isinstance(workload, Mixed):
        assert {r["kind"] for r in requests} == {"long-prompt", "long-output"}
    if isinstance(workload, ShareGPTLike):  # lengths drawn, not fixed
        assert len({(r["prompt_len"], r["output_len"]) for r in requests}) > NUM_REQUESTS // 2
    assert api.local_prefills(cluster_url) == {}, "the disaggregated cluster kept the split"


def test_trace_replays_its_prompts_and_timestamps(
    api: Any, cluster_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(e) for e in TRACE) + "\n\n")
    tokenizer = Tokenizer(demo_model_dir)
    want = [
        (
            len(e["prompt_token_ids"])
            if "prompt_token_ids" in e
            else len(tokenizer.encode(e["prompt"])),
            e["output_len"],
        )
        for e in TRACE
    ]
    result = bench(cluster_url, Trace(str(trace)), TraceTimes(), tmp_path / "out")
    check_run(read_json(tmp_path / "out")["runs"][0], want)
    starts = [r.start_s for r in sorted(result.records, key=lambda r: r.index)]
    assert starts[2] - starts[0] >= 0.05 - 0.005  # replayed at its own (relative) times
    assert api.local_prefills(cluster_url) == {}


def test_cli_rate_sweep_prints_the_table_and_plots_goodput(
    api: Any, cluster_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "sweep"
    argv = ["bench", "--url", cluster_url, "--workload", "shared-prefix", "--rate", "40,80"]
    argv += ["--num-requests", str(NUM_REQUESTS), "--num-prefixes", "2", "--prefix-len", "32"]
    argv += ["--suffix-len", "8", "--output-len", "3", "--slo-ttft", "30", "--slo-tpot", "30"]
    argv += ["--out", str(out_dir), "--no-progress"]
    assert cli_main(argv) == 0
    machine_line, printed = capsys.readouterr().out.split("\n", 1)
    assert machine_line == cpu_line()  # the CPU first, with every figure
    assert printed == (out_dir / "bench.md").read_text()
    assert read_json(out_dir)["machine"] == machine()
    assert "rate 40 req/s" in printed and "rate 80 req/s" in printed and "| TTFT |" in printed
    runs = read_json(out_dir)["runs"]
    assert [r["arrival"]["rate"] for r in runs] == [40.0, 80.0]
    for run in runs:
        check_run(run, [(40, 3)] * NUM_REQUESTS)
    # The second run sends the same prompts again: its prefixes are cached by then.
    assert runs[1]["summary"]["server"]["prefix_hit_rate"]["prefill"] > 0
    assert (out_dir / "goodput_vs_rate.png").read_bytes().startswith(b"\x89PNG")
    assert api.local_prefills(cluster_url) == {}


# -- client deadlines, against a server that misbehaves -----------------------------------


class SilentServer:
    """HTTP/1.1 on 127.0.0.1 (a port the OS picks) whose completions go silent.

    `mode`: "stall" streams `num_chunks` SSE chunks of text (no token ids, no usage: a
    plain OpenAI server) then sends nothing; "no_first_token" sends the headers and an
    SSE comment, never a token; "no_headers" sends nothing at all; "http_error" answers
    500. `GET /v1/models` names one model; anything else is a 404. Every response says
    `Connection: close`. `closed` is set when a client closes a stream the server held
    open; `last_sent_s` is when it last wrote to it.
    """

    def __init__(self, mode: str, num_chunks: int = 2) -> None:
        self.mode, self.num_chunks = mode, num_chunks
        self.closed = asyncio.Event()
        self.last_sent_s = math.nan
        self.closed_s = math.nan
        self.url = ""
        self.authorizations: list[str] = []  # each request's Authorization header

    async def __aenter__(self) -> SilentServer:
        # Listening once start_server returns: that is the readiness signal.
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await asyncio.wait_for(self.server.wait_closed(), 10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await reader.readline()
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.lower()] = value.strip()
            self.authorizations.append(headers.get("authorization", ""))
            length = int(headers.get("content-length", "0"))
            await reader.readexactly(length)
            method, path = request_line.decode().split()[:2]
            if (method, path) == ("POST", "/v1/completions") and self.mode != "http_error":
                await self._hold(reader, writer)
            elif (method, path) == ("GET", "/v1/models"):
                self._reply(writer, 200, json.dumps({"data": [{"id": "silent"}]}))
            else:
                self._reply(writer, 500 if path == "/v1/completions" else 404, "{}")
            await writer.drain()
        finally:
            writer.close()

    def _reply(self, writer: asyncio.StreamWriter, status: int, body: str) -> None:
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
        writer.write(
            f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode()
        )

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode != "no_headers":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
            writer.write(b"Connection: close\r\n\r\n: keep-alive\r\n\r\n")
        if self.mode == "stall":
            for i in range(self.num_chunks):
                chunk = {"choices": [{"index": 0, "text": f"x{i}", "finish_reason": None}]}
                writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await writer.drain()
        self.last_sent_s = time.perf_counter()
        await asyncio.wait_for(reader.read(), 60)  # EOF: the client closed the connection
        self.closed_s = time.perf_counter()
        self.closed.set()


async def bench_silent(
    mode: str, limits: ClientLimits, api_key: str | None = None
) -> tuple[BenchResult, SilentServer]:
    async with SilentServer(mode) as server:
        result = await run_benchmark(
            server.url,
            SharedPrefix(1, 8, 4, 8),
            Poisson(math.inf),
            num_requests=1,
            limits=limits,
            api_key=api_key,
            progress=False,
        )
        if mode != "http_error":
            await asyncio.wait_for(server.closed.wait(), 10)
    assert asyncio.all_tasks() == {asyncio.current_task()}, "no task left behind"
    return result, server


MARGIN_S = 1.0  # a busy 2-core machine: scheduling, not the deadline, sets this


def test_a_stalled_stream_fails_as_stall_within_its_timeout() -> None:
    limits = ClientLimits(first_token_timeout_s=30.0, stall_timeout_s=0.5)
    result, server = asyncio.run(bench_silent("stall", limits))
    (record,) = result.records
    assert (record.success, record.reason, record.output_tokens) == (False, "stall", 2)
    assert record.ttft_s is not None and record.e2e_s is not None
    assert 0.5 <= record.e2e_s - record.ttft_s < 0.5 + MARGIN_S
    # The server saw the connection go away when the deadline passed, not later.
    assert 0.5 - 0.05 <= server.closed_s - server.last_sent_s < 0.5 + MARGIN_S
    assert result.summary.failures == {"stall": 1} and result.summary.num_succeeded == 0
    assert result.summary.server is None  # this server has no /metrics
    assert result.model == ModelInfo("silent", DEMO_VOCAB, DEMO_CONTEXT)


@pytest.mark.parametrize("mode", ["no_first_token", "no_headers"])
def test_a_first_token_that_never_comes_fails_within_its_timeout(mode: str) -> None:
    limits = ClientLimits(first_token_timeout_s=0.5, stall_timeout_s=30.0)
    result, server = asyncio.run(bench_silent(mode, limits))
    (record,) = result.records
    assert (record.success, record.reason, record.ttft_s) == (False, "first_token_timeout", None)
    assert record.e2e_s is not None and 0.5 <= record.e2e_s < 0.5 + MARGIN_S
    assert server.closed_s - server.last_sent_s < 0.5 + MARGIN_S
    assert result.summary.failures == {"first_token_timeout": 1}


def test_an_http_error_is_a_failure_with_its_status() -> None:
    result, server = asyncio.run(bench_silent("http_error", ClientLimits(5.0, 5.0), "key-1"))
    assert server.authorizations and set(server.authorizations) == {"Bearer key-1"}
    (record,) = result.records
    assert (record.success, record.reason) == (False, "http_500")
    assert result.summary.failures == {"http_500": 1}
    assert result.summary.goodput == 0.0


# -- workloads, without a server ----------------------------------------------------------

MODEL = ModelInfo("m", vocab_size=100, max_model_len=64)


def take(workload: Workload, n: int, seed: int = 0) -> list[Any]:
    it = workload.requests(MODEL, seed)
    return [next(it) for _ in range(n)]


def test_workloads_are_seeded_and_stay_inside_the_model() -> None:
    for workload in (
        SharedPrefix(3, 16, 4, 8),
        Mixed(0.3, 40, 4, 8, 20),
        ShareGPTLike(30, 30, 1.5),
    ):
        specs = take(workload, 50)
        assert [s.prompt for s in specs] == [s.prompt for s in take(workload, 50)]
        assert [s.prompt for s in specs] != [s.prompt for s in take(workload, 50, seed=1)]
        for s in specs:
            assert all(0 <= t < MODEL.vocab_size for t in s.prompt)
            assert s.output_len >= 1 and len(s.prompt) + s.output_len <= MODEL.max_model_len
    prefixes = {tuple(s.prompt[:16]) for s in take(SharedPrefix(3, 16, 4, 8), 50)}
    assert len(prefixes) == 3


def test_repeats_resend_earlier_requests_and_the_report_splits_hits() -> None:
    """`--repeat-fraction`: about that fraction resends an earlier request (seeded);
    the report counts the result cache's answers and the TTFT of hits and misses."""
    from pdserve.benchmarks.bench_client import RequestRecord
    from pdserve.benchmarks.bench_report import SLO, markdown, summarize
    from pdserve.benchmarks.bench_workloads import with_repeats

    def specs(seed: int) -> list[Any]:
        return list(
            itertools.islice(
                with_repeats(SharedPrefix(3, 16, 4, 8).requests(MODEL, 0), 0.5, seed), 400
            )
        )

    got = specs(1)
    assert got == specs(1) and got != specs(2)
    assert [s.index for s in got] == list(range(400))
    repeats = [s for s in got if s.repeat_of is not None]
    assert 160 <= len(repeats) <= 240  # 0.5 of 400: far inside 5 sigma (10)
    for s in repeats:
        was = got[s.repeat_of]
        assert was.repeat_of is None and was.index < s.index and was.prompt == s.prompt
    fresh = [s.prompt for s in got if s.repeat_of is None]
    assert fresh == [s.prompt for s in take(SharedPrefix(3, 16, 4, 8), len(fresh))]

    def record(i: int, status: str, ttft: float) -> RequestRecord:
        r = RequestRecord(i, "", 0.0, 4, 8, output_tokens=8, ttft_s=ttft, e2e_s=ttft + 1)
        r.success, r.result_cache, r.repeat_of = True, status, 0 if status == "hit" else None
        return r

    records = [record(0, "miss", 0.4), record(1, "miss", 0.6), record(2, "hit", 0.002)]
    records += [record(3, "hit", 0.004), record(4, "bypass", 0.5)]
    summary = summarize(records, 1.0, SLO())
    rc = summary.result_cache
    assert rc is not None and (rc.hits, rc.misses, rc.bypassed, rc.repeats) == (2, 2, 1, 2)
    assert rc.hit_rate == pytest.approx(0.4)
    assert rc.ttft_hit_s.p50 == pytest.approx(0.003) and rc.ttft_miss_s.p50 == pytest.approx(0.5)
    table = markdown([("run", summary)])
    assert "| result cache hit rate | 40.0% (2 hits, 2 misses, 1 bypassed" in table
    assert "| TTFT p50 hits / misses | 3.0 / 500.0 ms |" in table
    no_header = [record(0, "", 0.4)]
    assert summarize(no_header, 1.0, SLO()).result_cache is None  # another server


def test_bad_configurations_raise() -> None:
    with pytest.raises(ValueError, match="exceed the model's context"):
        take(SharedPrefix(1, 60, 4, 8), 1)
    with pytest.raises(ValueError, match="endless"):
        asyncio.run(run_benchmark("http://127.0.0.1:1", SharedPrefix(), Poisson(1.0)))


def test_a_bad_trace_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps(TRACE[0]) + "\n" + json.dumps({"timestamp": 1, "prompt": "x"}) + "\n"
    )
    with pytest.raises(ValueError, match=r"t.jsonl:2: bad trace entry"):
        load_trace(path)


def test_compare_reports_disagg_decisions_from_a_real_scrape_format() -> None:
    """`bench --compare` prints where the disaggregated cluster prefilled, from /metrics."""
    text = (
        "# TYPE pdserve_disagg_decisions_total counter\n"
        'pdserve_disagg_decisions_total{reason="faster",where="local"} 17.0\n'
        'pdserve_disagg_decisions_total{reason="short_prompt",where="local"} 0.0\n'
        'pdserve_disagg_decisions_total{reason="prefill_idle",where="remote"} 79.0\n'
        'pdserve_decode_local_prefill_total{reason="policy"} 17.0\n'
    )
    got = compare._decisions(parse_scrape(text))
    assert got == {"local/faster": 17.0, "remote/prefill_idle": 79.0}
