"""A user's Django app: the middleware in settings, a view calling guarded work.

Django ships no type information, so its names are Any here; what idempo hands back is typed.
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse

from idempo.contrib.django import IdempotencyMiddleware

from .payments import charge

MIDDLEWARE = [
    "django.middleware.common.CommonMiddleware",
    f"{IdempotencyMiddleware.__module__}.{IdempotencyMiddleware.__qualname__}",
]
IDEMPO = {"store": "sqlite:///http.db", "methods": ("POST",)}


def create_payment(request: HttpRequest, order_id: str) -> JsonResponse:
    receipt = charge(order_id, int(request.POST.get("amount", "1")))
    amount: int = receipt.amount
    return JsonResponse({"order": receipt.order_id, "amount": amount}, status=201)
