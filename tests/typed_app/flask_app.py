"""A user's Flask app: the WSGI middleware guards POST, the view calls guarded work."""

from __future__ import annotations

from flask import Flask, request

from idempo import open_store
from idempo.wsgi import IdempotencyWSGIMiddleware, current_attempt

from .payments import charge

app = Flask(__name__)
app.wsgi_app = IdempotencyWSGIMiddleware(  # type: ignore[method-assign]
    app.wsgi_app, store=open_store("sqlite:///http.db"), routes=app
)


@app.post("/payments/<order_id>")
def create_payment(order_id: str) -> tuple[dict[str, object], int]:
    attempt = current_attempt(request.environ)
    receipt = charge(order_id, int(request.args.get("amount", "1")))
    return {"key": attempt.scope.key, "order": receipt.order_id}, 201
