"""OpenTelemetry tracing of requests: a span per HTTP request in the ingress, and a child span
in the engine replica that served it, linked by W3C trace context passed with the call.

The engine span carries events for the request's life: queued (arrival), scheduled (first
admitted to a batch), first_token, and finished (with the reason; preemptions counted as an
attribute). Exporters: `none` (no tracer at all: tracing costs one `is None` check per
request), `console` (stdout), `file` (JSON lines appended to a path, one span per line: what
the tests read, from every replica process), `otlp` (needs `opentelemetry-exporter-otlp`).
Each replica process builds its own TracerProvider; nothing global is set.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from engine.core.outputs import RequestOutput

Exporter = Literal["none", "console", "file", "otlp"]


class TracingArgs(BaseModel):
    """deploy.yaml `tracing:`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exporter: Exporter = Field("none", description="none | console | file | otlp")
    file_path: str | None = Field(None, description="file: JSON lines path (appended).")
    otlp_endpoint: str | None = Field(
        None, description="otlp: collector endpoint (null: the exporter's default / env)."
    )
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="Share of requests traced (parent-based)."
    )
    service_name: str = Field("dynabatch", description="service.name resource attribute.")


class _JsonLinesExporter:
    """Appends each finished span as one JSON object per line (processes share the file)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]):
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = "".join(json.dumps(span_record(s)) + "\n" for s in spans)
        with self._lock, open(self.path, "a") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_record(span: Any) -> dict[str, Any]:
    ctx, parent = span.get_span_context(), span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "resource": dict(span.resource.attributes),
    }


def make_tracer(args: TracingArgs, role: str):
    """A tracer for this replica process, or None when tracing is off."""
    if args.exporter == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create(
        {"service.name": args.service_name, "dynabatch.role": role, "process.pid": os.getpid()}
    )
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(args.sample_ratio))
    )
    if args.exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif args.exporter == "file":
        if not args.file_path:
            raise ValueError("tracing.file_path: required with exporter 'file'")
        provider.add_span_processor(SimpleSpanProcessor(_JsonLinesExporter(args.file_path)))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(
                "tracing.exporter: 'otlp' needs the opentelemetry-exporter-otlp package"
            ) from None
        kwargs = {"endpoint": args.otlp_endpoint} if args.otlp_endpoint else {}
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(**kwargs)))
    return provider.get_tracer("dynabatch")


def inject(span) -> dict[str, str]:
    """W3C trace context of `span` as a plain dict, to send with the engine call."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract(carrier: dict[str, str] | None):
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier or {})


def wall_ns_of(monotonic_s: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (span event timestamps)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class RequestSpan:
    """One request's span, or a no-op when tracing is off (or the request is not sampled
    in): callers set attributes and events without checking. `request_span` ends it."""

    def __init__(self, span: Any = None) -> None:
        self.span = span
        self.finish_reason = "abort"  # what the span says if the request never completes

    def set(self, attributes: dict[str, Any]) -> None:
        if self.span is not None:
            self.span.set_attributes(attributes)

    def event(self, name: str, attributes: dict[str, Any] | None = None, **kw: Any) -> None:
        if self.span is not None:
            self.span.add_event(name, attributes or {}, **kw)

    def carrier(self) -> dict[str, str] | None:
        """W3C trace context to send with the engine call (None when not traced)."""
        return inject(self.span) if self.span is not None else None


@contextmanager
def request_span(
    tracer: Any, name: str, attributes: dict[str, Any], kind: str = "INTERNAL", parent=None
) -> Iterator[RequestSpan]:
    """The span of one request from start to end: it ends exactly once, when the block
    exits, with `dynabatch.finish_reason` ("abort" unless the request set another). A
    streamed response hands the block's exit to its body with an ExitStack."""
    if tracer is None:
        yield RequestSpan()
        return
    from opentelemetry.trace import SpanKind

    span = tracer.start_span(
        name, context=parent, kind=getattr(SpanKind, kind), attributes=attributes
    )
    handle = RequestSpan(span)
    try:
        yield handle
    finally:
        span.set_attribute("dynabatch.finish_reason", handle.finish_reason)
        span.end()


def record_engine_life(
    span: RequestSpan, final: RequestOutput, reason: str, started: float
) -> None:
    """The engine span's life-cycle: scheduled (queue time), preemptions, finished."""
    if final.queue_time_s is not None:
        # Queue time runs from the engine's arrival stamp, a little after `started` (both
        # monotonic): `started + queue time` is at most that little early.
        span.event("scheduled", timestamp=wall_ns_of(started + final.queue_time_s))
    span.set({"dynabatch.output_tokens": final.num_output_tokens})
    span.set({"dynabatch.num_preemptions": final.num_preemptions})
    if final.num_preemptions:
        span.event("preempted", {"count": final.num_preemptions})
    span.event("finished", {"finish_reason": reason})
    span.finish_reason = reason
