"""Tracing is off unless the standard OTEL_* variables ask for it (cluster/tracing.py).

Off, no provider is built, the global one stays OpenTelemetry's no-op proxy and callers
get None (they create no span at all). The W3C carrier round trip is checked without a
provider. tests/deploy/test_tracing.py checks the spans of a real cluster.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from pdserve.cluster import tracing

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0xB7AD6B7169203331


@pytest.fixture
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import os

    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(tracing, "_tracers", {})
    monkeypatch.setattr(tracing, "_providers", [])
    yield


@pytest.mark.usefixtures("no_otel_env")
def test_off_without_otel_variables() -> None:
    assert not tracing.enabled()
    for role in ("router", "prefill", "decode"):
        assert tracing.tracer(role) is None
    assert tracing._providers == []  # nothing built, nothing exporting
    # the global provider was never replaced by an SDK one
    from opentelemetry.sdk.trace import TracerProvider

    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
    tracing.flush()  # nothing to flush: a no-op


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),  # a name alone exports nothing
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, False),
    ],
)
def test_enabled_by_the_standard_variables(env: dict[str, str], on: bool) -> None:
    assert tracing.enabled(env) is on


def test_w3c_carrier_round_trip() -> None:
    span = NonRecordingSpan(
        SpanContext(TRACE_ID, SPAN_ID, is_remote=False, trace_flags=TraceFlags(1))
    )
    carrier = tracing.carrier(span)
    assert carrier["traceparent"] == f"00-{TRACE_ID:032x}-{SPAN_ID:016x}-01"
    context = tracing.parent(carrier)
    assert context is not None
    got = trace.get_current_span(context).get_span_context()
    assert (got.trace_id, got.span_id, got.is_remote) == (TRACE_ID, SPAN_ID, True)
    assert tracing.parent(None) is None
    assert tracing.parent({}) is None


@pytest.mark.usefixtures("no_otel_env")
def test_on_builds_one_provider_per_role(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    tracer = tracing.tracer("prefill")
    try:
        assert tracer is not None
        assert tracing.tracer("prefill") is tracer  # once per process and role
        (provider,) = tracing._providers
        assert provider.resource.attributes["service.name"] == "pdserve-prefill"
        assert provider.resource.attributes["pdserve.role"] == "prefill"
        monkeypatch.setenv("OTEL_SERVICE_NAME", "my-llm")
        assert tracing.tracer("decode") is not None
        assert tracing._providers[1].resource.attributes["service.name"] == "my-llm"
    finally:
        for provider in tracing._providers:
            provider.shutdown()


@pytest.mark.usefixtures("no_otel_env")
def test_exporter_follows_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPC
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTP

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    exporter = tracing._exporter()
    assert isinstance(exporter, GRPC)
    exporter.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    exporter = tracing._exporter()
    assert isinstance(exporter, HTTP)
    exporter.shutdown()
