"""Everything a store author needs, in one public place (docs/extending.md, "Writing a store").

A store answers `Store.reserve` with exactly one of `Acquired`, `Replay`, `Mismatch` and
`InProgress` (together: `Reservation`); `judge` turns the record its atomic reservation
found into the right one. It keeps `Record` values per `Scope`, in a `Status`, and raises the
errors below. It plugs in by URL scheme with a `StoreKind`, through `register` or an
``idempo.stores`` entry point, and proves itself with `idempo.testing.StoreContract`.

    from idempo.stores.spi import Acquired, Record, Status, StoreKind, judge, register

>>> from datetime import UTC, datetime, timedelta
>>> now = datetime(2026, 1, 1, tzinfo=UTC)
>>> record = Record(Scope.of("k", operation="op"), "fp", Status.COMPLETED, 1, None, b"ok",
...                 now, now, now + timedelta(hours=1))
>>> judge(record, "fp", now)  # doctest: +ELLIPSIS
Replay(record=Record(...))
>>> judge(record, "another fingerprint", now)  # doctest: +ELLIPSIS
Mismatch(record=Record(...))
"""

from __future__ import annotations

from .._core.keys import Scope
from .._core.record import (
    Acquired,
    InProgress,
    Mismatch,
    Record,
    Replay,
    Reservation,
    Status,
    judge,
)
from ..errors import (
    ConfigurationError,
    CorruptRecordError,
    FencedError,
    SchemaMissingError,
    StoreError,
    StoreUnavailableError,
)
from ._registry import StoreKind, known_schemes, register
from .base import (
    AsyncStore,
    AsyncTransactionalStore,
    AsyncUnit,
    Mode,
    Store,
    TransactionalStore,
    Unit,
)

__all__ = [
    "Acquired",
    "AsyncStore",
    "AsyncTransactionalStore",
    "AsyncUnit",
    "ConfigurationError",
    "CorruptRecordError",
    "FencedError",
    "InProgress",
    "Mismatch",
    "Mode",
    "Record",
    "Replay",
    "Reservation",
    "SchemaMissingError",
    "Scope",
    "Status",
    "Store",
    "StoreError",
    "StoreKind",
    "StoreUnavailableError",
    "TransactionalStore",
    "Unit",
    "judge",
    "known_schemes",
    "register",
]
