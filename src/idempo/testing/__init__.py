"""Helpers for testing code that uses idempo: a clock you move by hand, and the store contract.

    clock = FakeClock()
    idem = Idempotency(store, Policy(clock=clock, sleep=clock.sleep))
    clock.advance(seconds=31)       # every lease taken before now has expired

    class TestMyStore(StoreContract):   # every rule a store must keep, as pytest tests
        @pytest.fixture
        def store(self):
            return MyStore()

`StoreContract` is imported on first use (``from idempo.testing import StoreContract``): it
needs pytest and anyio, which ``import idempo.testing`` for `FakeClock` does not.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .contract import StoreContract

__all__ = ["FakeClock", "StoreContract"]


def __getattr__(name: str) -> Any:
    # The contract imports pytest: only a test suite that asks for it pays for that.
    if name == "StoreContract":
        from .contract import StoreContract  # noqa: PLC0415

        return StoreContract
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class FakeClock:
    """A clock that moves only when told to; ``sleep`` moves it instead of waiting.

    >>> clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))
    >>> clock.advance(seconds=5); clock()
    datetime.datetime(2026, 1, 1, 0, 0, 5, tzinfo=datetime.timezone.utc)
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime.now(UTC)
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, delta: timedelta | None = None, *, seconds: float = 0) -> None:
        """Move the clock forward."""
        with self._lock:
            self._now += (delta or timedelta()) + timedelta(seconds=seconds)

    def sleep(self, seconds: float) -> None:
        """Advance instead of waiting, so tests of waiting never wait."""
        self.advance(seconds=seconds)
