"""OpenTelemetry for idempo: a span per guarded call and its metrics (``idempo[otel]``).

Register the observer on the guard; the HTTP middlewares and consumers built on that guard
report through it too::

    from idempo.otel import OpenTelemetryObserver

    idem = Idempotency(store, observers=[OpenTelemetryObserver()])

It uses the global tracer and meter providers unless given its own. With only
``opentelemetry-api`` installed (no SDK configured) every span and instrument is a no-op.

**Spans.** One ``INTERNAL`` span per guarded call, named ``idempo <operation>``, from the
call's start (before its fingerprint) to its final decision. While the work runs it is the
current span, so what the work traces is its child. Attributes: ``idempo.operation``,
``idempo.store``, ``idempo.surface``, ``idempo.outcome`` (a final `idempo.events.Kind`),
``idempo.token``, ``idempo.key.digest``, ``idempo.wait.duration`` (seconds),
``idempo.taken_over``; ``error.type`` (OpenTelemetry's semantic convention) names the
exception behind a refusal or a fault, and the span's status is ERROR when the store failed
or fenced the call. A lost lease is a span event (``idempo.lease_lost``).

**Metrics** (instrumentation scope ``idempo``; the names, then as Prometheus shows them):

===========================  ==================================  ==========================
``idempo.calls``             ``idempo_calls_total``              calls by operation, store,
                                                                 surface and outcome
``idempo.store.duration``    ``idempo_store_duration_seconds``   store latency per decision
``idempo.wait.duration``     ``idempo_wait_duration_seconds``    time spent waiting on a key
                                                                 in progress
``idempo.takeovers``         ``idempo_takeovers_total``          leases taken over
``idempo.fenced``            ``idempo_fenced_total``             fenced (refused) writes
``idempo.uncertain``         ``idempo_uncertain_total``          unrecorded, lease_lost,
                                                                 fail_open: to reconcile
===========================  ==================================  ==========================
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ._optional import optional_import
from .events import FINAL, Event, Kind

with optional_import("idempo.otel needs the OpenTelemetry API", extra="otel"):
    from opentelemetry import context, metrics, trace
    from opentelemetry.metrics import _internal as _metrics_internal
    from opentelemetry.trace import SpanKind, Status, StatusCode

__all__ = ["STORE_BUCKETS", "WAIT_BUCKETS", "OpenTelemetryObserver", "prometheus_meter_provider"]

STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Histogram buckets (seconds) for store latency: loopback round trips to slow commits."""
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Histogram buckets (seconds) for time spent waiting on a key in progress."""

# The final kinds that mean the store failed or fenced the call: the span's status is ERROR.
_FAULTS = frozenset({Kind.FENCED, Kind.UNRECORDED, Kind.STORE_UNAVAILABLE, Kind.PUBLISH_FAILED})
_UNCERTAIN = frozenset({Kind.UNRECORDED, Kind.LEASE_LOST, Kind.FAIL_OPEN})
_STARTS = frozenset({Kind.EXECUTED, Kind.TAKEN_OVER})


def _version() -> str:
    from . import __version__  # noqa: PLC0415 - the package imports this module's layer

    return __version__


class OpenTelemetryObserver:
    """An observer (`idempo.events.Observer`) that makes spans and metrics of idempo's
    decisions.

    Args:
        tracer_provider: where spans go; the global provider by default.
        meter_provider: where metrics go; the global provider by default.
        spans: make spans (True) or only metrics.

    >>> from idempo import Idempotency
    >>> from idempo.stores.memory import MemoryStore
    >>> idem = Idempotency(MemoryStore(), observers=[OpenTelemetryObserver()])
    >>> with idem.once("k-1", operation="pay") as attempt:   # no SDK: all no-ops
    ...     attempt.result = "paid"
    """

    def __init__(
        self,
        *,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        spans: bool = True,
    ) -> None:
        version = _version()
        self._tracer = trace.get_tracer("idempo", version, tracer_provider=tracer_provider)
        self._spans = spans
        # A provider of its own is live; the global ones are until an SDK is installed (it
        # may be later: the proxies then delegate), and are checked on each event.
        self._own_tracing = tracer_provider is not None
        self._own_metrics = meter_provider is not None
        # Dormant while neither global provider is set, unless a provider of its own records.
        self._quiet = not self._own_metrics and (not spans or not self._own_tracing)
        trace.get_tracer_provider()  # loads the one the environment names, if it names one
        metrics.get_meter_provider()
        meter = metrics.get_meter("idempo", version, meter_provider=meter_provider)
        self._calls = meter.create_counter(
            "idempo.calls", unit="{call}", description="Guarded calls, by outcome."
        )
        self._store = meter.create_histogram(
            "idempo.store.duration",
            unit="s",
            description="How long the store operation behind a decision took.",
            explicit_bucket_boundaries_advisory=STORE_BUCKETS,
        )
        self._wait = meter.create_histogram(
            "idempo.wait.duration",
            unit="s",
            description="Time a call spent waiting for another attempt holding its key.",
            explicit_bucket_boundaries_advisory=WAIT_BUCKETS,
        )
        self._takeovers = meter.create_counter(
            "idempo.takeovers",
            unit="{takeover}",
            description="Reservations that took over an attempt whose lease had ended.",
        )
        self._fenced = meter.create_counter(
            "idempo.fenced",
            unit="{write}",
            description="Outcomes refused because the attempt's lease was taken over.",
        )
        self._uncertain = meter.create_counter(
            "idempo.uncertain",
            unit="{call}",
            description="Work that ran without a record to rely on: reconcile it.",
        )
        # The span of each call under way (between its executed and final events), and the
        # context token that made it current.
        self._open: dict[int, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        if self._own_metrics or not _no_metrics():
            self._measure(event)
        if self._spans and (self._own_tracing or not _no_tracing()):
            self._span(event)

    def dormant(self) -> bool:
        """Whether every span and instrument would be a no-op now (the global providers are
        the API's own: no SDK is set up yet). The guard asks before each call and, while
        this says True, builds no event for it: the API alone costs next to nothing."""
        if (
            _GLOBALS_READABLE
            and trace._TRACER_PROVIDER is None
            and _metrics_internal._METER_PROVIDER is None
        ):
            # Neither global provider set (the usual state without an SDK), read in place:
            # this runs before every guarded call.
            return self._quiet
        if self._own_metrics or not _no_metrics():
            return False
        return not self._spans or (not self._own_tracing and _no_tracing())

    def _measure(self, event: Event) -> None:
        kind = event.kind
        labels = {
            "idempo.operation": event.operation,
            "idempo.store": event.store,
            "idempo.surface": event.surface,
        }
        if event.store_seconds is not None:
            self._store.record(
                event.store_seconds, {"idempo.store": event.store, "idempo.decision": kind.value}
            )
        if kind is Kind.WAITED:
            return  # its time is recorded with the decision that ended the wait
        if event.wait_seconds is not None:
            self._wait.record(event.wait_seconds, {**labels, "idempo.outcome": kind.value})
        if kind is Kind.TAKEN_OVER:
            self._takeovers.add(1, labels)
        elif kind is Kind.FENCED:
            self._fenced.add(1, labels)
        if kind in _UNCERTAIN:
            self._uncertain.add(1, {**labels, "idempo.outcome": kind.value})
        if kind in FINAL:
            self._calls.add(1, {**labels, "idempo.outcome": kind.value})

    def _span(self, event: Event) -> None:
        kind = event.kind
        if kind in _STARTS:
            span = self._tracer.start_span(
                f"idempo {event.operation}",
                kind=SpanKind.INTERNAL,
                start_time=_ns(event.started),
                attributes=self._attributes(event),
            )
            # Current while the work runs: what it traces is the call's child.
            current = context.attach(trace.set_span_in_context(span))
            with self._lock:
                self._open[event.call] = (span, current)
            return
        if kind is Kind.LEASE_LOST:
            with self._lock:
                opened = self._open.get(event.call)
            if opened is not None:
                opened[0].add_event("idempo.lease_lost", {"idempo.token": event.token or 0})
            return
        if kind not in FINAL:
            return  # fail_open: a run outside any guarded call; it is counted
        with self._lock:
            opened = self._open.pop(event.call, None)
        if opened is None:
            span = self._tracer.start_span(
                f"idempo {event.operation}",
                kind=SpanKind.INTERNAL,
                start_time=_ns(event.started),
                attributes=self._attributes(event),
            )
            token = None
        else:
            span, token = opened
        span.set_attribute("idempo.outcome", kind.value)
        if event.token is not None:
            span.set_attribute("idempo.token", event.token)
        if event.wait_seconds is not None:
            span.set_attribute("idempo.wait.duration", event.wait_seconds)
        if event.error is not None:
            span.set_attribute("error.type", type(event.error).__qualname__)
        if kind in _FAULTS:
            span.set_status(Status(StatusCode.ERROR, kind.value))
        span.end()
        if token is not None:
            # The final decision is heard in the call's own thread or task, where the span
            # was made current; a context changed under it meanwhile is OpenTelemetry's to
            # report (it logs, never raises).
            context.detach(token)

    @staticmethod
    def _attributes(event: Event) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "idempo.operation": event.operation,
            "idempo.store": event.store,
            "idempo.surface": event.surface,
            "idempo.key.digest": event.key_digest,
            "idempo.taken_over": event.kind is Kind.TAKEN_OVER,
        }
        if event.token is not None:
            attributes["idempo.token"] = event.token
        if event.wait_seconds is not None:
            attributes["idempo.wait.duration"] = event.wait_seconds
        if event.key is not None:
            attributes["idempo.key"] = event.key
        return attributes


def prometheus_meter_provider(registry: Any = None, **options: Any) -> Any:
    """An OpenTelemetry SDK ``MeterProvider`` whose metrics a Prometheus server scrapes:
    OpenTelemetry's Prometheus exporter collects them into ``registry`` (prometheus-client's
    default registry when None), which ``prometheus_client.start_http_server`` serves.
    ``options`` go to the ``MeterProvider`` (``resource=``, ``views=``). Needs
    ``opentelemetry-sdk`` and ``opentelemetry-exporter-prometheus``
    (``pip install 'idempo[prometheus]'``)::

        provider = prometheus_meter_provider()
        prometheus_client.start_http_server(9464)
        idem = Idempotency(store, observers=[OpenTelemetryObserver(meter_provider=provider)])
    """
    with optional_import("Prometheus metrics need the OpenTelemetry SDK", extra="prometheus"):
        # Here, not at the top: the observer needs only the API.
        from opentelemetry.exporter.prometheus import PrometheusMetricReader  # noqa: PLC0415
        from opentelemetry.sdk.metrics import MeterProvider  # noqa: PLC0415
    reader = (
        PrometheusMetricReader() if registry is None else PrometheusMetricReader(registry=registry)
    )
    return MeterProvider(metric_readers=[reader], **options)


# Whether the global providers are still the API's own (no SDK installed): every span and
# instrument is then a no-op, not worth feeding. Read on each event, from the globals that
# `set_tracer_provider` / `set_meter_provider` set: the public getters look the environment
# up each time (about a third of an observed call's cost). The observer calls the getters
# once when it is made, which loads a provider the environment names.
def _no_tracing() -> bool:
    provider = getattr(trace, "_TRACER_PROVIDER", _UNKNOWN)
    if provider is _UNKNOWN:  # another API version: the public, slower way
        provider = trace.get_tracer_provider()
        return isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
    return provider is None or isinstance(provider, trace.NoOpTracerProvider)


def _no_metrics() -> bool:
    provider = getattr(_metrics_internal, "_METER_PROVIDER", _UNKNOWN)
    if provider is _UNKNOWN:
        provider = metrics.get_meter_provider()
        return type(provider).__name__ == "_ProxyMeterProvider" or isinstance(
            provider, metrics.NoOpMeterProvider
        )
    return provider is None or isinstance(provider, metrics.NoOpMeterProvider)


_UNKNOWN = object()
# The API keeps each global provider in a module variable, None until one is set; read in
# place where this version of the API has them (`dormant`).
_GLOBALS_READABLE = (
    getattr(trace, "_TRACER_PROVIDER", _UNKNOWN) is not _UNKNOWN
    and getattr(_metrics_internal, "_METER_PROVIDER", _UNKNOWN) is not _UNKNOWN
)


# perf_counter and the wall clock advance together; one offset, taken once, maps the former
# (what events carry: no wall-clock step can stretch a duration) to the latter.
_OFFSET_NS = time.time_ns() - int(time.perf_counter() * 1e9)


def _ns(perf_seconds: float) -> int:
    return _OFFSET_NS + int(perf_seconds * 1e9)
