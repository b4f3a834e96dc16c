"""Observability (issue 13, part 1): an event per decision over every surface, OpenTelemetry
spans and metrics from them (the SDK's in-memory exporter and reader), a real Prometheus
scrape, log records with meaningful levels and structured fields, and no raw key in any log
line or in the guard's own messages by default."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import threading
import traceback
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from flask import Flask
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idempo import AsyncIdempotency, Idempotency, Policy
from idempo._core.keys import Scope
from idempo._core.record import Acquired
from idempo.asgi import IdempotencyMiddleware
from idempo.consumer import AsyncConsumer, Consumer, Envelope, Reason
from idempo.errors import (
    ConfigurationError,
    FencedError,
    FingerprintMismatchError,
    RequestInProgressError,
    StoreError,
    StoreUnavailableError,
)
from idempo.events import FINAL, Emitter, Event, Kind, key_digest
from idempo.otel import OpenTelemetryObserver, prometheus_meter_provider
from idempo.outbox import Outbox, OutboxMessage, Relay
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore
from idempo.testing import FakeClock
from idempo.wsgi import IdempotencyWSGIMiddleware

SECRET = "order-4711-very-secret-key"  # a key that must never show in a log line
LEASE = timedelta(seconds=10)


class Telemetry:
    """The SDK's in-memory span exporter and metric reader behind one observer."""

    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.observer = OpenTelemetryObserver(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider
        )
        self.events: list[Event] = []

    def observers(self) -> list[Any]:
        return [self.events.append, self.observer]

    def kinds(self) -> list[Kind]:
        return [event.kind for event in self.events]

    def outcomes(self) -> list[str]:
        return [str(span.attributes["idempo.outcome"]) for span in self.spans.get_finished_spans()]

    def metric(self, name: str) -> dict[frozenset[tuple[str, Any]], Any]:
        """Each data point of metric ``name``: attributes -> value (a count for histograms)."""
        points: dict[frozenset[tuple[str, Any]], Any] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        for point in metric.data.data_points:
                            value = getattr(point, "value", None)
                            if value is None:
                                value = point.count  # type: ignore[attr-defined]
                            points[frozenset(point.attributes.items())] = value
        return points

    def calls(self) -> Counter[str]:
        """``idempo.calls`` summed by outcome."""
        total: Counter[str] = Counter()
        for attributes, value in self.metric("idempo.calls").items():
            total[dict(attributes)["idempo.outcome"]] += value
        return total

    def close(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    t = Telemetry()
    yield t
    t.close()


def run(idem: Idempotency, key: str, result: Any = "ok", **options: Any) -> Any:
    with idem.once(key, operation="charge", **options) as attempt:
        if not attempt.replayed:
            attempt.result = result
    return attempt.result


class Faulty(MemoryStore):
    """A memory store whose verbs fail on demand, as an unreachable store's do."""

    def __init__(self) -> None:
        super().__init__()
        self.failing: set[str] = set()

    def reserve(self, *args: Any, **kwargs: Any) -> Any:
        if "reserve" in self.failing:
            raise StoreUnavailableError("the store cannot be reached")
        return super().reserve(*args, **kwargs)

    def complete(self, *args: Any, **kwargs: Any) -> Any:
        if "complete" in self.failing:
            raise StoreUnavailableError("the store cannot be reached")
        return super().complete(*args, **kwargs)


# --- the function API, sync ------------------------------------------------------------


def test_every_decision_of_the_function_api(telemetry: Telemetry) -> None:
    """executed+completed, replayed, mismatch, in_progress, released, failed: one event per
    decision, one span and one count per call, with its outcome."""
    idem = Idempotency(
        MemoryStore(), Policy(fail_on=(ValueError,)), observers=telemetry.observers()
    )
    assert run(idem, "k-1", {"id": 1}) == {"id": 1}
    assert run(idem, "k-1") == {"id": 1}
    with pytest.raises(FingerprintMismatchError):
        run(idem, "k-1", payload={"other": True})
    holder = idem.begin("k-2", operation="charge")
    with pytest.raises(RequestInProgressError):
        run(idem, "k-2")
    holder.finish("done")
    with pytest.raises(KeyError), idem.once("k-3", operation="charge"):
        raise KeyError("transient")
    with pytest.raises(ValueError, match="deterministic"), idem.once("k-4", operation="charge"):
        raise ValueError("deterministic")

    assert telemetry.kinds() == [
        Kind.EXECUTED, Kind.COMPLETED,
        Kind.REPLAYED,
        Kind.MISMATCH,
        Kind.EXECUTED,  # the holder
        Kind.IN_PROGRESS,
        Kind.COMPLETED,  # the holder finishing
        Kind.EXECUTED, Kind.RELEASED,
        Kind.EXECUTED, Kind.FAILED,
    ]  # fmt: skip
    first, completed = telemetry.events[:2]
    assert first.call == completed.call
    assert first.token == completed.token
    assert (first.operation, first.store, first.surface) == ("charge", "MemoryStore", "function")
    assert first.key_digest == key_digest("k-1")
    assert first.key is None
    assert completed.final
    assert completed.duration_seconds is not None
    assert completed.store_seconds is not None
    assert completed.store_seconds >= 0
    assert isinstance(telemetry.events[3].error, FingerprintMismatchError)
    assert isinstance(telemetry.events[8].error, KeyError)  # why it was released
    # One span per call, ended by its final decision.
    assert sorted(telemetry.outcomes()) == sorted(
        ["completed", "replayed", "mismatch", "in_progress", "completed", "released", "failed"]
    )
    assert telemetry.calls() == {
        "completed": 2, "replayed": 1, "mismatch": 1, "in_progress": 1, "released": 1,
        "failed": 1,
    }  # fmt: skip
    span = next(s for s in telemetry.spans.get_finished_spans() if s.name == "idempo charge")
    assert span.attributes is not None
    assert span.attributes["idempo.store"] == "MemoryStore"
    assert span.attributes["idempo.key.digest"] in {key_digest(k) for k in ("k-1", "k-2")}
    assert "idempo.token" in span.attributes
    store_latency = telemetry.metric("idempo.store.duration")
    assert sum(store_latency.values()) >= 8  # a reservation or a settling per decision


def test_the_work_is_traced_as_the_calls_child(telemetry: Telemetry) -> None:
    """While the work runs, idempo's span is the current one."""
    idem = Idempotency(MemoryStore(), observers=telemetry.observers())
    tracer = telemetry.tracer_provider.get_tracer("app")
    with idem.once("k-1", operation="charge") as attempt:
        with tracer.start_as_current_span("psp.charge"):
            pass
        attempt.result = 1
    work, call = telemetry.spans.get_finished_spans()
    assert work.name == "psp.charge"
    assert call.name == "idempo charge"
    assert work.parent is not None
    assert work.parent.span_id == call.context.span_id


def test_a_takeover_a_lost_lease_and_a_fenced_outcome(telemetry: Telemetry) -> None:
    """The first holder stalls past its lease; the second takes it over (taken_over, counted);
    the first's renewal finds its lease lost (lease_lost) and its outcome is refused (fenced,
    counted, an ERROR span)."""
    clock = FakeClock()
    idem = Idempotency(
        MemoryStore(), Policy(clock=clock, lease=LEASE), observers=telemetry.observers()
    )
    stale = idem.begin("k-1", operation="charge")
    clock.advance(LEASE * 2)
    assert run(idem, "k-1", "second") == "second"
    with pytest.raises(FencedError):
        stale.attempt.renew()
    with pytest.raises(FencedError):
        stale.finish("first")
    assert telemetry.kinds() == [
        Kind.EXECUTED, Kind.TAKEN_OVER, Kind.COMPLETED, Kind.LEASE_LOST, Kind.FENCED,
    ]  # fmt: skip
    assert telemetry.events[3].uncertain
    assert telemetry.events[4].token == telemetry.events[0].token
    assert sum(telemetry.metric("idempo.takeovers").values()) == 1
    assert sum(telemetry.metric("idempo.fenced").values()) == 1
    uncertain = telemetry.metric("idempo.uncertain")
    assert [dict(a)["idempo.outcome"] for a in uncertain] == ["lease_lost"]
    fenced = next(s for s in telemetry.spans.get_finished_spans() if s.status.is_ok is False)
    assert fenced.attributes is not None
    assert fenced.attributes["idempo.outcome"] == "fenced"
    assert fenced.attributes["error.type"] == "FencedError"
    assert [e.name for e in fenced.events] == ["idempo.lease_lost"]
    taken = next(
        s
        for s in telemetry.spans.get_finished_spans()
        if s.attributes and s.attributes.get("idempo.taken_over")
    )
    assert taken.attributes is not None
    assert taken.attributes["idempo.outcome"] == "completed"


def test_waiting_on_a_key_in_progress_is_timed(telemetry: Telemetry) -> None:
    """With ``Policy.wait`` a call waits for the holder and replays its result: a waited
    event, then the replay, both with the wait (on the injected clock), and the histogram."""
    clock = FakeClock()
    store = MemoryStore()
    holder_guard = Idempotency(store, Policy(clock=clock))
    holder = holder_guard.begin("k-1", operation="charge")
    began = clock()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock() - began >= timedelta(seconds=0.2) and holder._flow is not None:
            holder.finish("first")  # the holder finishes while the call waits

    waiting = Idempotency(
        store,
        Policy(clock=clock, wait=timedelta(seconds=5), sleep=sleep),
        observers=telemetry.observers(),
    )
    assert run(waiting, "k-1") == "first"
    assert telemetry.kinds() == [Kind.WAITED, Kind.REPLAYED]
    waited, replayed = telemetry.events
    assert waited.wait_seconds == pytest.approx(0.2, abs=0.06)
    assert replayed.wait_seconds == waited.wait_seconds
    (count,) = telemetry.metric("idempo.wait.duration").values()
    assert count == 1
    (span,) = telemetry.spans.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["idempo.wait.duration"] == pytest.approx(0.2, abs=0.06)


def test_store_faults_before_and_after_the_work(telemetry: Telemetry) -> None:
    """A store down at reservation: store_unavailable (nothing ran); down when recording:
    unrecorded (the work ran; reconcile). Both ERROR spans and counted."""
    store = Faulty()
    idem = Idempotency(store, observers=telemetry.observers())
    store.failing = {"reserve"}
    with pytest.raises(StoreUnavailableError):
        run(idem, "k-1")
    store.failing = {"complete"}
    with pytest.raises(StoreUnavailableError):
        run(idem, "k-2")
    assert telemetry.kinds() == [Kind.STORE_UNAVAILABLE, Kind.EXECUTED, Kind.UNRECORDED]
    assert telemetry.events[2].uncertain
    assert telemetry.events[2].final
    assert telemetry.calls() == {"store_unavailable": 1, "unrecorded": 1}
    assert all(not s.status.is_ok for s in telemetry.spans.get_finished_spans())


def test_an_observer_that_raises_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Kind] = []

    def broken(event: Event) -> None:
        raise RuntimeError("observer bug")

    idem = Idempotency(MemoryStore(), observers=[broken, lambda e: seen.append(e.kind)])
    with caplog.at_level(logging.ERROR, logger="idempo.events"):
        assert run(idem, "k-1") == "ok"
    assert seen == [Kind.EXECUTED, Kind.COMPLETED]
    assert "observer" in caplog.text
    assert "failed on a executed event" in caplog.text


def test_no_observer_builds_no_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no observer (and no DEBUG logger) the normal path makes no emitter and no event;
    a refusal is still reported (logged)."""
    from idempo import events

    made: list[str] = []
    real = events.Emitter.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(kwargs["operation"])
        real(self, *args, **kwargs)

    monkeypatch.setattr(events.Emitter, "__init__", counting)
    idem = Idempotency(MemoryStore())
    assert not idem._observing
    for _ in range(3):
        run(idem, "k-1")
    assert made == []
    with pytest.raises(FingerprintMismatchError):
        run(idem, "k-1", payload=b"other")
    assert made == ["charge"]


def test_every_store_reports_takeovers(store: Any) -> None:
    """Every store marks a reservation that took over an ended lease (`Acquired.taken_over`),
    and only that: not a new record, not one whose retention was over; a takeover with or
    without recorded steps alike."""
    clock = FakeClock()

    def reserve(scope: Scope, ttl: timedelta = timedelta(minutes=1)) -> Acquired:
        got = store.reserve(scope, "fp", now=clock(), lease=LEASE, ttl=ttl)
        assert isinstance(got, Acquired)
        return got

    plain, stepped, expired = (
        Scope("", "charge", f"k-{n}-{clock().timestamp()}") for n in range(3)
    )
    assert not reserve(plain).taken_over
    step = reserve(stepped)
    store.checkpoint(stepped, step.token, '{"steps": ["a"], "state": {}}', now=clock(), lease=LEASE)
    done = reserve(expired, ttl=timedelta(seconds=1))
    store.complete(expired, done.token, b"ok", now=clock(), ttl=timedelta(seconds=1))
    clock.advance(LEASE * 2)
    assert reserve(plain).taken_over
    assert reserve(stepped).taken_over
    assert not reserve(expired).taken_over  # its retention was over: a fresh record


GLOBAL_PROVIDERS = """
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from idempo import Idempotency
from idempo.otel import OpenTelemetryObserver
from idempo.stores.memory import MemoryStore

idem = Idempotency(MemoryStore(), observers=[OpenTelemetryObserver()])
with idem.once("before-the-sdk", operation="charge") as attempt:
    attempt.result = 1
spans = InMemorySpanExporter()
tracing = TracerProvider()
tracing.add_span_processor(SimpleSpanProcessor(spans))
trace.set_tracer_provider(tracing)
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
with idem.once("after-the-sdk", operation="charge") as attempt:
    attempt.result = 2
names = [s.name for s in spans.get_finished_spans()]
calls = [
    point.value
    for resource in reader.get_metrics_data().resource_metrics
    for scope in resource.scope_metrics
    for metric in scope.metrics
    if metric.name == "idempo.calls"
    for point in metric.data.data_points
]
print(names, calls)
"""


def test_the_global_providers_once_an_sdk_is_set_up() -> None:
    """On the API's global providers the observer does nothing until an SDK is installed,
    then reports through it (a process of its own: the globals are set once per process)."""
    ran = subprocess.run(
        [sys.executable, "-c", GLOBAL_PROVIDERS],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "['idempo charge'] [1]"


# --- the function API, async -----------------------------------------------------------


async def _async_calls(idem: AsyncIdempotency) -> None:
    for _ in range(2):
        async with idem.once("k-1", operation="ship") as attempt:
            if not attempt.replayed:
                attempt.result = "shipped"
    with pytest.raises(FingerprintMismatchError):
        async with idem.once("k-1", operation="ship", payload=b"other"):
            pass
    with pytest.raises(KeyError):
        async with idem.once("k-2", operation="ship"):
            raise KeyError("transient")


def test_the_async_function_api(telemetry: Telemetry) -> None:
    idem = AsyncIdempotency(AsyncMemoryStore(), observers=telemetry.observers())
    asyncio.run(_async_calls(idem))
    assert telemetry.kinds() == [
        Kind.EXECUTED, Kind.COMPLETED, Kind.REPLAYED, Kind.MISMATCH, Kind.EXECUTED,
        Kind.RELEASED,
    ]  # fmt: skip
    assert sorted(telemetry.outcomes()) == ["completed", "mismatch", "released", "replayed"]


def test_the_async_work_is_the_calls_child(telemetry: Telemetry) -> None:
    """Async store operations may run in tasks of their own; the span is still made current
    in the caller's task, where the work runs."""
    idem = AsyncIdempotency(AsyncMemoryStore(), observers=telemetry.observers())
    tracer = telemetry.tracer_provider.get_tracer("app")

    async def call() -> None:
        async with idem.once("k-1", operation="ship") as attempt:
            await asyncio.sleep(0)
            with tracer.start_as_current_span("carrier.book"):
                await asyncio.sleep(0)
            attempt.result = 1

    asyncio.run(call())
    work, span = telemetry.spans.get_finished_spans()
    assert work.parent is not None
    assert work.parent.span_id == span.context.span_id


def test_a_cancelled_async_call_is_released(telemetry: Telemetry) -> None:
    """A cancellation while the work runs: the key is released (and said so), the span
    ended, and the next call runs the work again."""
    idem = AsyncIdempotency(AsyncMemoryStore(), observers=telemetry.observers())

    async def main() -> bool:
        started = asyncio.Event()

        async def work() -> None:
            async with idem.once("k-1", operation="ship"):
                started.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(work())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with idem.once("k-1", operation="ship") as attempt:
            attempt.result = 1
        return attempt.replayed

    assert asyncio.run(main()) is False
    assert telemetry.kinds() == [Kind.EXECUTED, Kind.RELEASED, Kind.EXECUTED, Kind.COMPLETED]
    assert isinstance(telemetry.events[1].error, asyncio.CancelledError)
    assert sorted(telemetry.outcomes()) == ["completed", "released"]
    assert telemetry.observer._open == {}


# --- HTTP ------------------------------------------------------------------------------


def _asgi_app(idem: AsyncIdempotency, gate: asyncio.Event | None = None, **options: Any) -> Any:
    async def pay(request: Request) -> JSONResponse:
        amount = (await request.json())["amount"]
        if gate is not None and amount == 0:
            await gate.wait()  # held in progress until the test opens the gate
        return JSONResponse({"paid": amount}, status_code=201)

    app = Starlette(routes=[Route("/payments/{id}", pay, methods=["POST"])])
    return IdempotencyMiddleware(app, idempotency=idem, **options)


async def _post(app: Any, key: str, amount: int) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(
            "/payments/7", json={"amount": amount}, headers={"Idempotency-Key": key}
        )


def test_asgi_requests(telemetry: Telemetry, caplog: pytest.LogCaptureFixture) -> None:
    """A 201, its replay, a 422 and a 409 through the ASGI middleware: surface http, the
    route template as the operation; the refusals logged on idempo.http."""
    running = asyncio.Event()
    held_digest = key_digest("held-key")

    def held_runs(event: Event) -> None:
        if event.key_digest == held_digest and event.kind is Kind.EXECUTED:
            running.set()

    idem = AsyncIdempotency(AsyncMemoryStore(), observers=[*telemetry.observers(), held_runs])

    async def requests() -> list[int]:
        gate = asyncio.Event()
        app = _asgi_app(idem, gate)
        codes = [(await _post(app, SECRET, 5)).status_code for _ in range(2)]
        codes.append((await _post(app, SECRET, 6)).status_code)
        held = asyncio.create_task(_post(app, "held-key", 0))
        await running.wait()  # the held request runs, and holds its key
        codes.append((await _post(app, "held-key", 0)).status_code)
        gate.set()
        codes.append((await held).status_code)
        return codes

    with caplog.at_level(logging.DEBUG, logger="idempo"):
        assert asyncio.run(requests()) == [201, 201, 422, 409, 201]
    http = [e for e in telemetry.events if e.surface == "http"]
    assert [e.kind for e in http] == [
        Kind.EXECUTED, Kind.COMPLETED, Kind.REPLAYED, Kind.MISMATCH,
        Kind.EXECUTED, Kind.IN_PROGRESS, Kind.COMPLETED,
    ]  # fmt: skip
    assert {e.operation for e in http} == {"POST /payments/{id}"}
    assert telemetry.calls()["completed"] == 2
    levels = {r.idempo_kind: r.levelname for r in caplog.records if hasattr(r, "idempo_kind")}
    assert levels["replayed"] == "DEBUG"
    assert levels["mismatch"] == "WARNING"
    assert levels["in_progress"] == "INFO"
    assert {r.name for r in caplog.records if getattr(r, "idempo_surface", "") == "http"} == {
        "idempo.http"
    }
    assert SECRET not in caplog.text


def test_asgi_fail_open(telemetry: Telemetry, caplog: pytest.LogCaptureFixture) -> None:
    """The store down and fail_open on: store_unavailable (ERROR, idempo.store), then
    fail_open (WARNING, idempo.http, counted as uncertain); the request runs unguarded."""
    store = AsyncMemoryStore()

    async def down(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailableError("connection refused")

    store.reserve = down  # type: ignore[method-assign]
    idem = AsyncIdempotency(store, observers=telemetry.observers())
    with caplog.at_level(logging.WARNING, logger="idempo"):
        assert asyncio.run(_post(_asgi_app(idem, fail_open=True), SECRET, 5)).status_code == 201
    assert telemetry.kinds() == [Kind.STORE_UNAVAILABLE, Kind.FAIL_OPEN]
    assert telemetry.events[1].uncertain
    records = [(r.name, r.levelname, r.idempo_kind) for r in caplog.records]
    assert records == [
        ("idempo.store", "ERROR", "store_unavailable"),
        ("idempo.http", "WARNING", "fail_open"),
    ]
    uncertain = telemetry.metric("idempo.uncertain")
    assert [dict(a)["idempo.outcome"] for a in uncertain] == ["fail_open"]
    assert SECRET not in caplog.text


def test_asgi_connection_that_cannot_open(telemetry: Telemetry, tmp_path: Path) -> None:
    """The app's connection cannot be opened (its database is the store): a 503, reported
    as store_unavailable by the middleware, since no guard ran."""
    store = AsyncSQLiteStore(str(tmp_path / "records.db"))

    @asynccontextmanager
    async def connection() -> AsyncIterator[Any]:
        raise OSError("database is down")
        yield

    async def call() -> int:
        await store.migrate()
        idem = AsyncIdempotency(store, observers=telemetry.observers())
        try:
            return (await _post(_asgi_app(idem, connection=connection), SECRET, 5)).status_code
        finally:
            await store.aclose()

    assert asyncio.run(call()) == 503
    assert telemetry.kinds() == [Kind.STORE_UNAVAILABLE]
    assert telemetry.events[0].surface == "http"
    assert telemetry.events[0].operation == "POST /payments/{id}"


def test_wsgi_flask_requests(telemetry: Telemetry) -> None:
    idem = Idempotency(MemoryStore(), observers=telemetry.observers())
    app = Flask(__name__)

    @app.post("/orders/<int:order>")
    def order(order: int) -> tuple[dict[str, int], int]:
        return {"order": order}, 201

    app.wsgi_app = IdempotencyWSGIMiddleware(app.wsgi_app, idempotency=idem)  # type: ignore[method-assign]
    client = app.test_client()
    codes = [
        client.post("/orders/1", json={"n": n}, headers={"Idempotency-Key": SECRET}).status_code
        for n in (1, 1, 2)
    ]
    assert codes == [201, 201, 422]  # a replay answers the first response, status and all
    assert telemetry.kinds() == [Kind.EXECUTED, Kind.COMPLETED, Kind.REPLAYED, Kind.MISMATCH]
    assert {e.surface for e in telemetry.events} == {"http"}
    assert {e.operation for e in telemetry.events} == {"POST /orders/<int:order>"}


def test_a_middlewares_own_guard_takes_observers(telemetry: Telemetry, tmp_path: Path) -> None:
    """``store=`` with ``observers=`` (and ``reveal_keys=``): the middleware's own guard
    reports, on ASGI and WSGI alike; with a shared guard the options are refused, since
    that guard has its own."""

    async def pay(request: Request) -> JSONResponse:
        return JSONResponse({"paid": 1}, status_code=201)

    starlette = Starlette(routes=[Route("/payments/{id}", pay, methods=["POST"])])
    asgi = IdempotencyMiddleware(
        starlette, store=AsyncMemoryStore(), observers=telemetry.observers(), reveal_keys=True
    )
    assert [asyncio.run(_post(asgi, SECRET, 5)).status_code for _ in range(2)] == [201, 201]
    assert telemetry.kinds() == [Kind.EXECUTED, Kind.COMPLETED, Kind.REPLAYED]
    assert {e.key for e in telemetry.events} == {SECRET}

    flask = Flask(__name__)

    @flask.post("/orders")
    def order() -> tuple[dict[str, int], int]:
        return {"order": 1}, 201

    store = SQLiteStore(str(tmp_path / "idem.db"))
    store.migrate()
    seen: list[Event] = []
    flask.wsgi_app = IdempotencyWSGIMiddleware(  # type: ignore[method-assign]
        flask.wsgi_app, store=store, observers=[seen.append]
    )
    client = flask.test_client()
    for _ in range(2):
        client.post("/orders", json={}, headers={"Idempotency-Key": SECRET})
    assert [e.kind for e in seen] == [Kind.EXECUTED, Kind.COMPLETED, Kind.REPLAYED]
    assert {(e.store, e.key) for e in seen} == {("SQLiteStore", None)}
    store.close()

    with pytest.raises(ConfigurationError, match="observers go with store="):
        IdempotencyMiddleware(starlette, idempotency=AsyncIdempotency(AsyncMemoryStore()),
                              observers=[seen.append])  # fmt: skip


# --- consumers -------------------------------------------------------------------------


def test_a_consumer(telemetry: Telemetry, caplog: pytest.LogCaptureFixture) -> None:
    """Executed, duplicate, mismatch through `Consumer`: surface consumer in events and spans;
    the consumer's own log lines carry the id's digest and structured fields."""
    idem = Idempotency(MemoryStore(), observers=telemetry.observers())
    consumer = Consumer(idem, name="billing.charge", horizon=timedelta(0))
    with caplog.at_level(logging.DEBUG, logger="idempo.consumer"):
        reasons = [
            consumer.process(None, Envelope(SECRET, body), lambda d: "charged").reason
            for body in (b"{}", b"{}", b"{other}")
        ]
    assert reasons == [Reason.EXECUTED, Reason.DUPLICATE, Reason.MISMATCH]
    assert telemetry.kinds() == [Kind.EXECUTED, Kind.COMPLETED, Kind.REPLAYED, Kind.MISMATCH]
    assert {e.surface for e in telemetry.events} == {"consumer"}
    assert telemetry.calls() == {"completed": 1, "replayed": 1, "mismatch": 1}
    records = [r for r in caplog.records if r.name == "idempo.consumer"]
    assert [(r.levelname, r.idempo_outcome) for r in records] == [
        ("DEBUG", "executed"), ("INFO", "duplicate"), ("ERROR", "mismatch"),
    ]  # fmt: skip
    assert {r.idempo_key_digest for r in records} == {key_digest(SECRET)}
    assert all(r.idempo_operation == "billing.charge" for r in records)
    assert SECRET not in caplog.text


def test_an_async_consumer(telemetry: Telemetry) -> None:
    idem = AsyncIdempotency(AsyncMemoryStore(), observers=telemetry.observers())
    consumer = AsyncConsumer(idem, name="orders", horizon=timedelta(0))

    async def handle(delivery: Any) -> str:
        return "done"

    async def twice() -> list[Reason]:
        return [
            (await consumer.process(None, Envelope("e-1", b"{}"), handle)).reason for _ in range(2)
        ]

    assert asyncio.run(twice()) == [Reason.EXECUTED, Reason.DUPLICATE]
    assert sorted(telemetry.outcomes()) == ["completed", "replayed"]


# --- Prometheus --------------------------------------------------------------------------


def test_a_real_prometheus_scrape(telemetry: Telemetry) -> None:
    """The metrics, through OpenTelemetry's Prometheus exporter, served on a free port and
    parsed with Prometheus' own text parser."""
    registry = CollectorRegistry()
    provider = prometheus_meter_provider(registry)
    clock = FakeClock()
    idem = Idempotency(
        MemoryStore(),
        Policy(clock=clock, lease=LEASE),
        observers=[OpenTelemetryObserver(meter_provider=provider, spans=False)],
    )
    run(idem, "k-1")
    run(idem, "k-1")
    with pytest.raises(FingerprintMismatchError):
        run(idem, "k-1", payload=b"x")
    stale = idem.begin("k-2", operation="charge")
    clock.advance(LEASE * 2)
    run(idem, "k-2")
    with pytest.raises(FencedError):
        stale.finish("late")
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        provider.shutdown()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    calls = Counter[str]()
    for sample in families["idempo_calls"].samples:
        assert sample.name == "idempo_calls_total"
        assert sample.labels["idempo_operation"] == "charge"
        assert sample.labels["idempo_store"] == "MemoryStore"
        calls[sample.labels["idempo_outcome"]] += int(sample.value)
    assert calls == {"completed": 2, "replayed": 1, "mismatch": 1, "fenced": 1}
    assert families["idempo_store_duration_seconds"].type == "histogram"
    assert [s.value for s in families["idempo_takeovers"].samples] == [1.0]
    assert [s.value for s in families["idempo_fenced"].samples] == [1.0]
    buckets = [
        s for s in families["idempo_store_duration_seconds"].samples if s.name.endswith("_bucket")
    ]
    assert {s.labels["le"] for s in buckets} >= {"0.001", "0.01", "+Inf"}


# --- logging and keys --------------------------------------------------------------------


def test_levels_fields_and_no_raw_key(caplog: pytest.LogCaptureFixture) -> None:
    """A replay is DEBUG, a mismatch WARNING, a fenced stale holder and a store failure
    ERROR; every record carries its fields in ``extra``; the key shows as its digest only,
    in every log line and in the error text the log lines quote."""
    clock = FakeClock()
    store = Faulty()
    with caplog.at_level(logging.DEBUG, logger="idempo"):
        idem = Idempotency(store, Policy(clock=clock, lease=LEASE))  # DEBUG: observed
        assert idem._observing
        run(idem, SECRET)
        run(idem, SECRET)
        with pytest.raises(FingerprintMismatchError):
            run(idem, SECRET, payload=b"x")
        stale = idem.begin(SECRET + "-2", operation="charge")
        clock.advance(LEASE * 2)
        run(idem, SECRET + "-2")
        with pytest.raises(FencedError):
            stale.finish("late")
        store.failing = {"reserve"}
        with pytest.raises(StoreError):
            run(idem, SECRET + "-3")
    records = [r for r in caplog.records if hasattr(r, "idempo_kind")]
    seen = [(r.name, r.levelname, r.idempo_kind) for r in records]
    assert seen == [
        ("idempo.guard", "DEBUG", "executed"),
        ("idempo.guard", "DEBUG", "completed"),
        ("idempo.guard", "DEBUG", "replayed"),
        ("idempo.guard", "WARNING", "mismatch"),
        ("idempo.guard", "DEBUG", "executed"),
        ("idempo.guard", "WARNING", "taken_over"),
        ("idempo.guard", "DEBUG", "completed"),
        ("idempo.guard", "ERROR", "fenced"),
        ("idempo.store", "ERROR", "store_unavailable"),
    ]
    for record in records:
        assert record.idempo_operation == "charge"
        assert record.idempo_store == "Faulty"
        assert record.idempo_key_digest in {
            key_digest(k) for k in (SECRET, SECRET + "-2", SECRET + "-3")
        }
        assert not hasattr(record, "idempo_key")
    fenced = next(r for r in records if r.idempo_kind == "fenced")
    assert isinstance(fenced.idempo_token, int)
    assert all(SECRET not in r.getMessage() for r in caplog.records)
    assert f"#{key_digest(SECRET + '-2')}" in fenced.getMessage()  # the store's text, scrubbed


def test_refusals_are_logged_without_any_observer(caplog: pytest.LogCaptureFixture) -> None:
    """No observer and no DEBUG logger: the normal path logs nothing, a refusal or a fault
    still gets its line."""
    idem = Idempotency(MemoryStore())
    with caplog.at_level(logging.INFO, logger="idempo"):
        run(idem, SECRET)
        run(idem, SECRET)
        with pytest.raises(FingerprintMismatchError):
            run(idem, SECRET, payload=b"x")
    assert [(r.levelname, r.idempo_kind) for r in caplog.records] == [("WARNING", "mismatch")]
    assert SECRET not in caplog.text


def test_revealing_keys_is_an_opt_in(caplog: pytest.LogCaptureFixture) -> None:
    events: list[Event] = []
    idem = Idempotency(MemoryStore(), observers=[events.append], reveal_keys=True)
    with caplog.at_level(logging.WARNING, logger="idempo"):
        run(idem, SECRET)
        with pytest.raises(FingerprintMismatchError):
            run(idem, SECRET, payload=b"x")
    assert {e.key for e in events} == {SECRET}
    (record,) = caplog.records
    assert record.idempo_key == SECRET
    assert SECRET in record.getMessage()


def test_the_guards_own_messages_carry_a_digest() -> None:
    """A corrupt stored result: the error names the key by its digest, and says how to
    evict the record without spelling out the key or the principal."""
    store = MemoryStore()
    idem = Idempotency(store)
    run(idem, SECRET)
    entry = next(iter(store._entries.values()))
    entry.response = b"\xff not json"
    with pytest.raises(StoreError) as raised:
        run(idem, SECRET)
    message = str(raised.value)
    assert key_digest(SECRET) in message
    assert SECRET not in message
    assert "idempo evict STORE-URL KEY --operation charge --principal PRINCIPAL" in message


def test_final_kinds_end_every_call(telemetry: Telemetry) -> None:
    """Many calls from threads: every call's events end in exactly one final kind, and its
    span is ended (none left open)."""
    idem = Idempotency(MemoryStore(), observers=telemetry.observers())

    def worker(n: int) -> None:
        for i in range(20):
            with contextlib.suppress(FingerprintMismatchError, RequestInProgressError):
                run(idem, f"k-{i % 5}", payload={"n": n % 2})

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    finals = Counter(e.call for e in telemetry.events if e.kind in FINAL)
    calls = {e.call for e in telemetry.events}
    assert len(calls) == 80
    assert set(finals.values()) == {1}
    assert len(telemetry.spans.get_finished_spans()) == 80
    assert telemetry.observer._open == {}


# --- the outbox relay ----------------------------------------------------------------------


def test_the_outbox_relay(telemetry: Telemetry, tmp_path: Path) -> None:
    """Each message the relay publishes, or fails to, is an event on the relay surface (the
    destination as its operation, the message id as its key), a span and a count; a failed
    publish's span is an error and carries the broker's exception type."""
    from idempo.stores.sqlite import SQLiteStore

    url = f"sqlite:///{tmp_path / 'app.db'}"
    store = SQLiteStore(str(tmp_path / "app.db"))
    store.migrate()
    outbox = Outbox()
    outbox.migrate(store)
    conn = store.connect()
    ids = []
    with Idempotency(store).once(SECRET, operation="capture", conn=conn) as attempt:
        ids = [outbox.stage(conn, attempt, "payments", {"n": n}).id for n in (1, 2)]
        attempt.result = "ok"
    conn.close()
    store.close()

    class Flaky:
        calls = 0

        async def publish(self, message: OutboxMessage) -> None:
            self.calls += 1
            if self.calls == 2:
                raise ConnectionError("the broker is down")

    async def relay_twice() -> None:
        async with Relay(
            url, Flaky(), observers=telemetry.observers(), backoff=lambda n: timedelta(0)
        ) as relay:
            assert tuple(await relay.drain()) == (1, 1)
            assert tuple(await relay.drain()) == (1, 0)

    asyncio.run(relay_twice())
    assert telemetry.kinds() == [Kind.PUBLISHED, Kind.PUBLISH_FAILED, Kind.PUBLISHED]
    assert [e.key for e in telemetry.events] == [ids[0], ids[1], ids[1]]
    assert {(e.surface, e.operation, e.store) for e in telemetry.events} == {
        ("relay", "payments", "sqlite")
    }
    assert isinstance(telemetry.events[1].error, ConnectionError)
    spans = telemetry.spans.get_finished_spans()
    assert [str(s.attributes["idempo.outcome"]) for s in spans] == [
        "published", "publish_failed", "published",
    ]  # fmt: skip
    assert spans[1].status.status_code.name == "ERROR"
    assert spans[1].attributes["error.type"] == "ConnectionError"
    assert telemetry.calls() == {"published": 2, "publish_failed": 1}


def test_errors_name_the_key_by_its_digest_on_every_store(store: Any) -> None:
    """What a real store raises (in progress, mismatch, a stale holder fenced), causes
    included, names the key by its digest or not at all: an app that logs the exception does
    not log the key. The key is still the exception's attribute, for the app."""
    clock = FakeClock()
    idem = Idempotency(store, Policy(clock=clock, lease=LEASE))
    stale = idem.begin(SECRET, operation="charge")
    raised: list[BaseException] = []
    with pytest.raises(RequestInProgressError) as busy:
        run(idem, SECRET)
    assert busy.value.key == SECRET
    raised.append(busy.value)
    clock.advance(LEASE * 2)
    run(idem, SECRET)  # takes the key over
    with pytest.raises(FencedError) as fenced:
        stale.finish("late")
    raised.append(fenced.value)
    with pytest.raises(FingerprintMismatchError) as mismatch:
        run(idem, SECRET, payload=b"other")
    raised.append(mismatch.value)
    for exc in raised:
        text = "".join(traceback.format_exception(exc))  # with every cause: the driver's too
        assert SECRET not in text, text
    assert key_digest(SECRET) in str(busy.value)
    assert key_digest(SECRET) in str(mismatch.value)


def test_a_dormant_observer_costs_no_event(
    monkeypatch: pytest.MonkeyPatch, telemetry: Telemetry
) -> None:
    """An observer that says it is dormant (an OpenTelemetry observer with no SDK behind it)
    makes the guard build no event while it says so, and every event once it wakes; a plain
    callable beside it keeps every call observed."""
    built: list[Kind] = []
    real_emit = Emitter.emit

    def counting(self: Emitter, kind: Kind, **fields: Any) -> Event:
        built.append(kind)
        return real_emit(self, kind, **fields)

    monkeypatch.setattr(Emitter, "emit", counting)

    class Sleepy:
        asleep = True
        heard: list[Kind] = []  # noqa: RUF012 - one instance per test

        def dormant(self) -> bool:
            return self.asleep

        def __call__(self, event: Event) -> None:
            self.heard.append(event.kind)

    sleepy = Sleepy()
    idem = Idempotency(MemoryStore(), observers=[sleepy])
    run(idem, "k-1")
    assert built == []
    sleepy.asleep = False
    run(idem, "k-2")
    assert sleepy.heard == built == [Kind.EXECUTED, Kind.COMPLETED]
    sleepy.asleep = True
    plain: list[Event] = []
    run(Idempotency(MemoryStore(), observers=[sleepy, plain.append]), "k-3")
    assert [e.kind for e in plain] == [Kind.EXECUTED, Kind.COMPLETED]
    # On the global providers, still the API's own in this process: dormant; on providers
    # of its own (an SDK's), awake, for spans and for metrics alike.
    assert OpenTelemetryObserver().dormant()
    assert not telemetry.observer.dormant()
    metrics_only = OpenTelemetryObserver(meter_provider=telemetry.meter_provider, spans=False)
    assert not metrics_only.dormant()
    assert OpenTelemetryObserver(tracer_provider=telemetry.tracer_provider, spans=False).dormant()
