"""OpenTelemetry tracing of requests across the router, prefill and decode processes.

Off unless the standard variables ask for it: `OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set, `OTEL_TRACES_EXPORTER` not `none` and
`OTEL_SDK_DISABLED` not `true`. Then each process gets its own `TracerProvider`
(service name `OTEL_SERVICE_NAME`, else `pdserve-<role>`) with a `BatchSpanProcessor`
and the OTLP exporter: gRPC, or HTTP with `OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf`.
The exporters read the other `OTEL_EXPORTER_OTLP_*` and `OTEL_BSP_*` variables
themselves. Off, `tracer()` returns None and callers skip every span: no provider, no
context propagation, nothing per token.

The context crosses processes as a W3C carrier (`{"traceparent": ..., "tracestate": ...}`),
an explicit argument of the router's calls to the workers (`carrier`, `parent`): not
Ray's own tracing. The provider is not made the global one (Ray's processes are
shared with Ray's own code); docs/metrics.md, "Tracing", lists the spans.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C Trace Context
_PROPAGATOR = TraceContextTextMapPropagator()
_lock = threading.Lock()
_tracers: dict[str, Tracer | None] = {}  # role -> its tracer in this process (None: off)
_providers: list[Any] = []


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the OTEL_* variables of `env` (default: this process's) ask for traces."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if exporters in ("none", ""):
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARS)


def tracer(role: str) -> Tracer | None:
    """This process's tracer for `role` ("router", "prefill", "decode"); None when off.

    The first call for a role builds its provider and exporter; later calls return it.
    """
    with _lock:
        if role not in _tracers:
            _tracers[role] = _build(role) if enabled() else None
        return _tracers[role]


def _build(role: str) -> Tracer:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes: dict[str, Any] = {"pdserve.role": role, "process.pid": os.getpid()}
    if not os.environ.get("OTEL_SERVICE_NAME", "").strip():
        attributes["service.name"] = f"pdserve-{role}"
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(_exporter()))
    _providers.append(provider)
    return provider.get_tracer("pdserve")


def _exporter() -> Any:
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol.strip().lower().startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPExporter,
        )

        return HTTPExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def flush(timeout_s: float = 5.0) -> None:
    """Export what this process's providers hold (a replica shutting down)."""
    for provider in list(_providers):
        provider.force_flush(int(timeout_s * 1000))


def parent(carrier: Mapping[str, str] | None) -> Context | None:
    """The context a W3C carrier names (None: no carrier, or no valid `traceparent`)."""
    if not carrier or "traceparent" not in carrier:
        return None
    return _PROPAGATOR.extract(carrier)


def carrier(span: Span) -> dict[str, str]:
    """The W3C carrier of `span`, for a call to another process."""
    out: dict[str, str] = {}
    _PROPAGATOR.inject(out, context=set_span_in_context(span))
    return out


def start(
    tracer: Tracer,
    name: str,
    parent: Span | Context | None,
    *,
    start_s: float | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
) -> Span:
    """A span, child of `parent` (a span, or a context from `parent()`; None: a new
    trace), started now or at `start_s` (a `time.monotonic()` reading). End it."""
    if parent is None:
        context = Context()  # a root, whatever this task's current context holds
    elif isinstance(parent, Span):
        context = set_span_in_context(parent)
    else:
        context = parent
    return tracer.start_span(
        name,
        context=context,
        kind=kind,
        attributes=attributes,
        start_time=None if start_s is None else epoch_ns(start_s),
    )


def record(
    tracer: Tracer,
    name: str,
    parent: Span,
    start_s: float,
    end_s: float,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """A span timed after the fact, from two `time.monotonic()` readings."""
    span = start(tracer, name, parent, start_s=start_s, attributes=attributes)
    span.end(end_time=epoch_ns(max(end_s, start_s)))


def fail(span: Span, exc: BaseException | str) -> None:
    """Mark `span` failed (with the exception as an event when there is one)."""
    if isinstance(exc, BaseException):
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
    else:
        span.set_status(Status(StatusCode.ERROR, exc))


def epoch_ns(monotonic_s: float) -> int:
    """Wall-clock nanoseconds of a `time.monotonic()` reading (spans timed after the fact)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
