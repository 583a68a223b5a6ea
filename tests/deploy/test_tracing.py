"""Tracing end to end: one disaggregated request is one trace across three processes.

The test process runs an in-memory OTLP/gRPC trace receiver and starts `pdserve up`
(1 prefill + 1 decode worker, gRPC transport, `--disagg-policy always`) with the standard
variables pointing at it, as an operator would. One request from the official `openai`
client carries a W3C `traceparent`; its spans, from the router, the prefill and the
decode processes, must all be in the client's trace, linked by their parent ids up to
the router's server span, whose parent is the client's span (cluster/tracing.py;
docs/metrics.md, "Tracing").
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

BLOCK_SIZE = 8
MAX_TOKENS = 4
SERVICES = {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
FLAGS = (
    *("--mode", "disagg", "--transport", "grpc", "--disagg-policy", "always"),
    *("--prefill-replicas", "1", "--decode-replicas", "1", "--dtype", "float32"),
    *("--block-size", str(BLOCK_SIZE), "--replica-cpus", "0", "--threads", "1"),
    *("--heartbeat-s", "0.5"),
)
SPANS_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    attributes: dict[str, Any]
    events: tuple[str, ...]
    start_ns: int
    end_ns: int


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps what it receives in memory."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name")),
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=tuple(e.name for e in s.events),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                        )
                    )
        with self.lock:
            self.spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    collector = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, port
    finally:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def traced_cluster(
    make_checkpoint: Any, pdserve_up: Any, receiver: tuple[Receiver, int]
) -> Iterator[str]:
    """`pdserve up` with tracing on (its processes inherit the OTEL_* variables)."""
    model_dir = Path(make_checkpoint(num_heads=4, num_kv_heads=2, max_position_embeddings=512))
    _, port = receiver
    with contextlib.ExitStack() as stack:
        env = stack.enter_context(pytest.MonkeyPatch.context())
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        env.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # milliseconds
        env.delenv("OTEL_SERVICE_NAME", raising=False)
        env.delenv("OTEL_TRACES_EXPORTER", raising=False)
        env.delenv("OTEL_SDK_DISABLED", raising=False)
        url = stack.enter_context(pdserve_up(model_dir, *FLAGS))
        env.undo()  # the cluster has them; this process keeps tracing off
        yield url


def _trace_once_complete(collector: Receiver, trace_id: str) -> Any:
    """A `poll` check: the trace's spans once every service's have come (the router's
    server span last), else None."""
    spans = collector.trace(trace_id)
    names = {s.name for s in spans}
    done = {s.service for s in spans} >= SERVICES and {
        "POST /v1/completions",
        "pdserve.prefill",
        "pdserve.decode",
    } <= names
    return spans if done else None


def test_one_request_is_one_trace_across_router_prefill_decode(
    traced_cluster: str, receiver: tuple[Receiver, int], api: Any, poll: Any
) -> None:
    url = traced_cluster
    collector, _ = receiver
    rng = random.Random(7)
    client_trace = f"{rng.getrandbits(128):032x}"
    client_span = f"{rng.getrandbits(64):016x}"
    prompt = [rng.randrange(5, 512) for _ in range(5 * BLOCK_SIZE + 3)]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        extra_headers={"traceparent": f"00-{client_trace}-{client_span}-01"},
    )
    tokens = [t for chunk in stream for t in chunk.choices[0].model_extra["token_ids"]]
    assert len(tokens) == MAX_TOKENS

    spans = poll(
        f"trace {client_trace} complete",
        lambda: _trace_once_complete(collector, client_trace),
        SPANS_TIMEOUT_S,
    )
    by_id = {s.span_id: s for s in spans}
    by_name: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    assert {s.service for s in spans} == SERVICES
    expected = {
        "pdserve-router": {"POST /v1/completions", "pdserve.placement", "pdserve.dispatch"},
        "pdserve-prefill": {
            "pdserve.prefill",
            "pdserve.prefill.queue",
            "pdserve.prefill.compute",
            "pdserve.kv.push",
        },
        "pdserve-decode": {
            "pdserve.decode",
            "pdserve.kv.receive",
            "pdserve.decode.queue",
            "pdserve.decode.stream",
        },
    }
    for service, names in expected.items():
        have = {s.name for s in spans if s.service == service}
        assert names <= have, f"{service}: missing {names - have}"

    # The router's server span is the child of the client's span.
    (root,) = by_name["POST /v1/completions"]
    assert root.service == "pdserve-router"
    assert root.kind == 2  # SPAN_KIND_SERVER
    assert root.parent_id == client_span
    assert root.attributes["gen_ai.usage.input_tokens"] == len(prompt)
    assert root.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert root.attributes["http.response.status_code"] == 200
    assert "first_token" in root.events

    # Every span lies within the router's (one clock: the processes share the machine).
    slack_ns = 50_000_000
    for s in spans:
        assert root.start_ns - slack_ns <= s.start_ns <= s.end_ns <= root.end_ns + slack_ns

    # Every other span chains up, by parent ids, to the router's server span.
    for s in spans:
        hops, at = 0, s
        while at is not root:
            assert at.parent_id in by_id, f"{s.service} {s.name}: broken parent link"
            at, hops = by_id[at.parent_id], hops + 1
            assert hops < 10
    (placement,) = by_name["pdserve.placement"]
    (dispatch,) = by_name["pdserve.dispatch"]
    assert placement.parent_id == root.span_id
    assert dispatch.parent_id == root.span_id
    # Across processes: the workers' spans are children of the router's dispatch span.
    (prefill,) = by_name["pdserve.prefill"]
    (decode,) = by_name["pdserve.decode"]
    assert prefill.service == "pdserve-prefill" and prefill.parent_id == dispatch.span_id
    assert decode.service == "pdserve-decode" and decode.parent_id == dispatch.span_id
    for name in ("pdserve.prefill.queue", "pdserve.prefill.compute", "pdserve.kv.push"):
        assert by_name[name][0].parent_id == prefill.span_id
    for name in ("pdserve.kv.receive", "pdserve.decode.queue", "pdserve.decode.stream"):
        assert by_name[name][0].parent_id == decode.span_id
    request_id = root.attributes["pdserve.request_id"]
    for s in (dispatch, prefill, decode):
        assert s.attributes["pdserve.request_id"] == request_id
    assert (
        dispatch.attributes["pdserve.prefill.worker_id"]
        == prefill.attributes["pdserve.prefill.worker_id"]
    )
    assert (
        dispatch.attributes["pdserve.decode.worker_id"]
        == decode.attributes["pdserve.decode.worker_id"]
    )

    # The KV really crossed: pushed with bytes, received and used, no local prefill.
    (push,) = by_name["pdserve.kv.push"]
    assert push.attributes["pdserve.kv.bytes"] > 0
    assert push.attributes["pdserve.kv.blocks"] > 0
    assert push.attributes["pdserve.kv.transport"] == "grpc"
    (received,) = by_name["pdserve.kv.receive"]
    assert received.attributes["pdserve.kv.used"] is True
    assert received.attributes["pdserve.kv.bytes"] > 0
    assert received.attributes["pdserve.kv.blocks"] == push.attributes["pdserve.kv.blocks"]
    assert decode.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert "first_token" in decode.events
    assert api.metric(url, "pdserve_kv_transfer_blocks_total") > 0
    assert api.local_prefills(url) == {}
    # never the prompt's tokens or text in a span: counts only
    for s in spans:
        for value in s.attributes.values():
            assert value != prompt and value != str(prompt)
