"""The example payments API (FastAPI), guarded by idempo's ASGI middleware.

    POST /payments          {"amount": 1..100000000, "currency": "EUR", "card": 12-19 digits}
                            Idempotency-Key required; Authorization: Bearer <token> optional
                            (the principal); X-Demo-Delay-Ms: 0..60000 (hold the reservation
                            that long before charging); X-Demo-Fail: transient (fail with 503
                            before charging; the key is released)
                            -> 201 payment, Location: /payments/<id>
                            -> 402 {"error": "card_declined", ...} for a card ending 0002
    GET  /payments/<id>     -> 200 payment, or 404
    GET  /demo/ledger       -> {"payments", "charges", "psp_calls", "double_charges", "events"}

The charge goes to a simulated payment provider, a separate system that deduplicates by the
key the endpoint derives from the request's (`idempo.derive_key`), so a crash after the
charge and a retry that executes again never charge twice. The endpoint runs
leased-then-transactional on SQL stores: the reservation commits first (a duplicate in flight
gets 409 at once); the payment row, its "payment.captured" event (staged in the outbox,
`idempo.outbox`) and the fenced response commit together at the end. A relay publishes the
event afterwards (``idempo relay``), with an id derived from the request's scope.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict
from datetime import timedelta
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from .._core.keys import derive_key
from .._wire import PROBLEM_MEDIA_TYPE, PROBLEM_TYPE_BASE
from ..asgi import IdempotencyMiddleware
from ..contrib.fastapi import document_idempotency
from ..contrib.starlette import current_attempt
from ..stores import open_async_store
from .backends import Backend, Payment, open_backend

__all__ = ["create_app"]

DEFAULT_LEASE = timedelta(seconds=10)
EVENTS = "payment.captured"
"""Where the "payment.captured" events go by default: a routing key, a subject, a stream."""
PROBLEM = PROBLEM_MEDIA_TYPE


def _json_integer(value: Any) -> Any:
    # JSON Schema's integer: 100 and 100.0, never "100" or true.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class PaymentRequest(BaseModel):
    """A payment to make. Strict: ``"100"`` is not an amount and unknown fields are refused."""

    model_config = ConfigDict(strict=True, extra="forbid")

    amount: Annotated[int, BeforeValidator(_json_integer)] = Field(
        ge=1, le=100_000_000, description="in minor units (cents)"
    )
    currency: str = Field(pattern="^[A-Z]{3}$", description="ISO 4217 code, e.g. EUR")
    card: str = Field(pattern="^[0-9]{12,19}$", description="card number; ending 0002 declines")


class PaymentOut(BaseModel):
    id: str
    amount: int
    currency: str
    status: Literal["succeeded"]
    charge_id: str


class Declined(BaseModel):
    error: Literal["card_declined"]
    message: str
    decline_code: str


class Problem(BaseModel):
    type: str
    title: str
    status: int
    detail: str


class LedgerOut(BaseModel):
    payments: int = Field(description="payment rows")
    charges: int = Field(description="distinct charges at the provider")
    psp_calls: int = Field(description="calls made to the provider")
    double_charges: int = Field(description="intents charged more than once")
    events: int = Field(description="payment.captured events staged in the outbox")


def _problem_response(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {PROBLEM: {"schema": Problem.model_json_schema()}},
    }


def problem(status: int, kind: str, title: str, detail: str, **headers: str) -> JSONResponse:
    """An RFC 9457 problem, in the same ``urn:idempo:problem:`` family as the middleware's."""
    body = {"type": PROBLEM_TYPE_BASE + kind, "title": title, "status": status, "detail": detail}
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers or None)


_INVALID = _problem_response("Invalid request")
# The example's own answers. The middleware documents its own (the Idempotency-Key header,
# Idempotent-Replayed, its 400, 409, 413, 422 and 503 problems: idempo.contrib.fastapi).
_OWN_ANSWERS: dict[int | str, dict[str, Any]] = {
    400: _problem_response("Invalid payment body (invalid-payment)"),
    # Declared, so FastAPI documents no validation-error 422: this API answers those 400.
    422: {"description": "Not a validation error: this API answers an invalid body 400"},
    503: _problem_response("X-Demo-Fail asked for a failure (psp-unavailable)"),
}


def create_app(
    store_url: str,
    *,
    lease: timedelta = DEFAULT_LEASE,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    events: str = EVENTS,
) -> FastAPI:
    """The example payments API on the store at ``store_url``, which also holds its data.

    Args:
        store_url: a ``sqlite://``, ``postgresql://`` or ``redis://`` store URL.
        lease: the reservation's lease; renewed while a handler lives, so a crashed
            server's keys free within one lease.
        sleep: how ``X-Demo-Delay-Ms`` waits (tests inject their own).
        events: the destination of the "payment.captured" events (SQL stores stage them
            in the outbox, ``idempo_outbox`` beside the records; Redis stages none).

    >>> app = create_app("sqlite:///payments.db")
    >>> sorted(route.path for route in app.routes if "payments" in route.path)
    ['/payments', '/payments/{payment_id}']
    """
    backend = open_backend(store_url)
    store = open_async_store(store_url)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        migrate = getattr(store, "migrate", None)
        if migrate is not None:
            await migrate()
            await backend.migrate(store)
        await backend.setup()
        try:
            yield
        finally:
            await backend.aclose()
            await store.aclose()

    app = FastAPI(
        title="idempo example payments API",
        version="1.0.0",
        description=__doc__,
        lifespan=lifespan,
    )
    app.add_middleware(
        IdempotencyMiddleware, store=store, lease=lease, **backend.middleware_options()
    )
    # The middleware documents itself once it serves; this makes app.openapi() say it too
    # before then (a schema exported for a client generator).
    document_idempotency(app)
    app.state.backend = backend
    app.add_exception_handler(RequestValidationError, _invalid_request)
    _routes(app, backend, sleep, events)
    return app


def _connection(request: Request) -> Any:
    # Annotations are evaluated at module level, so the backend is found through the app.
    backend: Backend = request.app.state.backend
    return backend.connection(request)


async def _invalid_request(_: Request, exc: Exception) -> JSONResponse:
    # 422 is kept for a key reused with another payload; a bad body is the client's 400.
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    detail = "; ".join(
        f"{'.'.join(str(part) for part in error.get('loc', ()))}: {error.get('msg', '')}"
        for error in errors
    )
    return problem(400, "invalid-payment", "Invalid payment request", detail or str(exc))


def _routes(
    app: FastAPI, backend: Backend, sleep: Callable[[float], Awaitable[None]], events: str
) -> None:
    @app.post(
        "/payments",
        status_code=201,
        response_model=PaymentOut,
        responses={
            201: {"headers": {"Location": {"schema": {"type": "string"}}}},
            402: {"model": Declined, "description": "The card was declined (stored, replayed)"},
            **_OWN_ANSWERS,
        },
    )
    async def create_payment(
        payment: PaymentRequest,
        request: Request,
        conn: Annotated[Any, Depends(_connection)],
        delay_ms: Annotated[int | None, Header(alias="X-Demo-Delay-Ms", ge=0, le=60_000)] = None,
        fail: Annotated[Literal["transient"] | None, Header(alias="X-Demo-Fail")] = None,
        authorization: Annotated[
            str | None, Header(description="Bearer <token>: who pays (the principal)")
        ] = None,
    ) -> Any:
        """Charge a card once per Idempotency-Key; every retry gets the first answer."""
        attempt = current_attempt(request)
        scope = attempt.scope
        if delay_ms:
            await sleep(delay_ms / 1000)
        if fail == "transient":
            return problem(
                503, "psp-unavailable", "Payment provider unavailable",
                "X-Demo-Fail asked for a transient failure; nothing was charged, retry.",
                **{"Retry-After": "1"},
            )  # fmt: skip
        # Derived from the whole scope: two principals' equal keys are distinct intents.
        payment_id = "pay_" + derive_key(scope.key, f"payment|{scope.principal}").replace("-", "")
        psp_key = derive_key(scope.key, f"psp.charge|{scope.principal}")
        charge = await backend.charge(
            psp_key, payment_id, payment.amount, payment.currency, payment.card
        )
        if charge.charge_id is None:
            declined = Declined(
                error="card_declined",
                message="The card was declined by the payment provider.",
                decline_code=charge.decline_code or "generic_decline",
            )
            return JSONResponse(declined.model_dump(), status_code=402)
        made = Payment(payment_id, payment.amount, payment.currency, "succeeded", charge.charge_id)
        await backend.add_payment(conn, made)
        captured = {"event": "payment.captured", **asdict(made)}
        await backend.stage_event(conn, attempt, events, captured)
        return JSONResponse(
            PaymentOut.model_validate(made, from_attributes=True).model_dump(),
            status_code=201,
            headers={"Location": f"/payments/{payment_id}"},
        )

    @app.get(
        "/payments/{payment_id}",
        response_model=PaymentOut,
        # "4XX" also keeps FastAPI from documenting a 422 this API never answers.
        responses={404: _problem_response("No such payment"), "4XX": _INVALID},
    )
    async def get_payment(payment_id: str) -> Any:
        """One payment."""
        found = await backend.payment(payment_id)
        if found is None:
            return problem(404, "not-found", "No such payment", f"no payment {payment_id!r}")
        return PaymentOut.model_validate(found, from_attributes=True)

    @app.get("/demo/ledger", response_model=LedgerOut)
    async def ledger() -> LedgerOut:
        """What happened, counted from the data: payments, provider charges and calls."""
        return LedgerOut(**(await backend.ledger()).as_json())
