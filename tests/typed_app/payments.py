"""The domain of a user's small payments service, guarded by idempo's function API.

Every ``assert_type`` below fails under ``mypy --strict`` if ``@idempotent`` stops keeping a
function's signature and return type; every ``type: ignore`` is an error mypy must keep
finding (``warn_unused_ignores`` turns a lost check into a failure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, assert_type

from idempo import (
    AsyncAttempt,
    AsyncIdempotency,
    Attempt,
    Idempotency,
    open_async_store,
    open_store,
)

idem = Idempotency(open_store("sqlite:///payments.db"))
aidem = AsyncIdempotency(open_async_store("sqlite:///payments.db"))


@dataclass
class Receipt:
    order_id: str
    amount: int


@idem.idempotent(key="order_id")
def charge(order_id: str, amount: int, *, currency: str = "EUR") -> Receipt:
    return Receipt(order_id, amount)


@aidem.idempotent(key="order_id", renew_every=10.0)
async def refund(order_id: str, amount: int) -> Receipt:
    return Receipt(order_id, -amount)


def ship(parcel_id: str) -> list[str]:
    return [parcel_id]


shipped = idem.idempotent(ship, key="parcel_id")  # the bare form: a function, not a decorator


def checked_sync() -> None:
    assert_type(charge("o-1", 5), Receipt)
    assert_type(charge("o-1", 5, currency="USD").amount, int)
    assert_type(shipped("p-1"), list[str])
    charge("o-1", "five")  # type: ignore[arg-type]
    charge("o-1", 5, colour="red")  # type: ignore[call-arg]


async def checked_async() -> None:
    assert_type(await refund("o-1", 5), Receipt)
    _ = refund("o-1", 5).amount  # type: ignore[attr-defined]  # a coroutine until awaited


def two_phases(order_id: str) -> Receipt:
    """An integration's view: the handle of one call, its attempt typed by the caller."""
    handle = idem.begin(order_id, operation="charge", payload={"order": order_id})
    attempt: Attempt[Receipt] = handle.attempt
    if not attempt.replayed:
        try:
            receipt = charge(order_id, 5)
        except BaseException as exc:
            handle.abort(exc)
            raise
        handle.finish(receipt)
    return attempt.result


async def two_phases_async(order_id: str) -> Any:
    handle = await aidem.begin(order_id, operation="refund")
    attempt: AsyncAttempt[Any] = handle.attempt
    if not attempt.replayed:
        await attempt.renew()
        await handle.finish({"refunded": order_id})
    with idem.once(order_id, operation="ship") as shipping:
        assert_type(shipping, Attempt)
        shipping.result = ship(order_id)
    return attempt.result
