"""A user's FastAPI app: the ASGI middleware guards POST, the handler calls guarded work; a
route whose key is optional says so with a dependency."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI, Request

from idempo.asgi import IdempotencyMiddleware
from idempo.contrib.fastapi import Idempotent, document_idempotency
from idempo.contrib.starlette import current_attempt
from idempo.http import json_field

from .payments import aidem, refund

app = FastAPI()
app.add_middleware(IdempotencyMiddleware, idempotency=aidem, methods=("POST",))


@app.post("/refunds/{order_id}", status_code=201)
async def create_refund(order_id: str, request: Request) -> dict[str, Any]:
    attempt = current_attempt(request)
    receipt = await refund(order_id, 5)
    return {"key": attempt.scope.key, "order": receipt.order_id, "amount": receipt.amount}


@app.post("/tips", dependencies=[Depends(Idempotent(require_key=False))])
async def tip() -> dict[str, int]:
    return {"tips": 1}


@app.post("/webhooks", dependencies=[Depends(Idempotent(key_from=json_field("id")))])
async def webhook() -> None: ...


document_idempotency(app)
