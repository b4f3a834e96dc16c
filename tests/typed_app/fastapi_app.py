"""A user's FastAPI app: the ASGI middleware guards POST, the handler calls guarded work."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from idempo.asgi import IdempotencyMiddleware
from idempo.contrib.starlette import current_attempt

from .payments import aidem, refund

app = FastAPI()
app.add_middleware(IdempotencyMiddleware, idempotency=aidem, methods=("POST",))


@app.post("/refunds/{order_id}", status_code=201)
async def create_refund(order_id: str, request: Request) -> dict[str, Any]:
    attempt = current_attempt(request)
    receipt = await refund(order_id, 5)
    return {"key": attempt.scope.key, "order": receipt.order_id, "amount": receipt.amount}
