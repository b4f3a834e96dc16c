"""What a Starlette or FastAPI endpoint behind `idempo.asgi.IdempotencyMiddleware` may use.

Transactional mode over HTTP: give the middleware a ``connection=`` factory and the endpoint
writes on the connection whose transaction also carries the idempotency record, so the
business write and the stored response commit together, or not at all.

    from typing import Annotated
    from fastapi import Depends, FastAPI
    from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
    from idempo.asgi import IdempotencyMiddleware
    from idempo.contrib.starlette import idempotent_connection

    engine = create_async_engine("postgresql+psycopg://app@db/app")
    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware, store="postgresql://app@db/app", connection=engine.connect
    )

    @app.post("/orders", status_code=201)
    async def create_order(
        order: Order, conn: Annotated[AsyncConnection, Depends(idempotent_connection)]
    ) -> dict[str, str]:
        await conn.execute(insert(orders).values(...))   # commits with the stored response
        return {"id": ...}

In plain Starlette, call ``idempotent_connection(request)`` inside the endpoint. Both
functions take only the request, so they are FastAPI dependencies as they stand.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from ..asgi import ATTEMPT_SCOPE_KEY, CONNECTION_SCOPE_KEY
from ..errors import ConfigurationError
from ..guard import AsyncAttempt

__all__ = ["current_attempt", "idempotent_connection"]


def idempotent_connection(request: Request) -> Any:
    """The connection whose transaction carries this request's idempotency record.

    Raises:
        ConfigurationError: the request is not guarded by a middleware with ``connection=``
            (a GET, a route outside the middleware, or a middleware without a connection).
    """
    conn = request.scope.get(CONNECTION_SCOPE_KEY)
    if conn is None:
        raise ConfigurationError(
            "no idempotent connection for this request: guard it with"
            " IdempotencyMiddleware(connection=...) and a guarded method"
        )
    return conn


def current_attempt(request: Request) -> AsyncAttempt:
    """This request's attempt: its scope (principal, operation, key) and fencing token.

    Use ``attempt.scope`` to derive downstream keys (`idempo.derive_key`), so a retry that
    executes again sends the payment provider the same key.

    Raises:
        ConfigurationError: the request is not guarded by the middleware.
    """
    attempt = request.scope.get(ATTEMPT_SCOPE_KEY)
    if attempt is None:
        raise ConfigurationError("this request is not guarded by IdempotencyMiddleware")
    attempt_: AsyncAttempt = attempt
    return attempt_
