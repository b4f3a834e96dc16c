"""Writes that are idempotent by construction: run them twice, or out of order, and the
table ends as if each distinct write had run once. Where a write can be shaped like this, it
needs no idempotency record (see docs/idempotent-by-construction.md).

- `create_once`: insert the row named by a natural (or derived) key, or find the one a
  previous call made; the row comes back either way, with whether it was created now.
- `update_if_version`: an optimistic-concurrency update, ``WHERE version = :expected``;
  `idempo.errors.VersionConflictError` when the version moved.
- `apply_if_newer`: last-writer-wins, in one statement: an event is applied only if its
  version (or timestamp) is greater than the row's, so duplicates and reordered deliveries
  are harmless.

Each takes a connection: a ``sqlite3.Connection``, a psycopg ``Connection``, a PyMySQL
``Connection`` or a SQLAlchemy ``Connection`` / ``Session`` (the ``a``-prefixed twins take a
psycopg ``AsyncConnection`` or a SQLAlchemy ``AsyncConnection`` / ``AsyncSession``), on
PostgreSQL, SQLite 3.35+ or MariaDB 10.5+. The table is a SQLAlchemy ``Table`` on a SQLAlchemy
connection, or a name (``"orders"``, ``"shop.orders"``) whose parts, like every column name,
must be plain identifiers: anything else is refused with a `ConfigurationError` before
anything runs. Values always travel as parameters.

**None of them commits.** They run inside the caller's transaction (the one the connection
is in, or the one its driver opens for the statement), so they compose with the caller's
other writes, and with idempo's own transactional guard, and commit or roll back with them.

    >>> import sqlite3
    >>> from idempo.writes import apply_if_newer
    >>> db = sqlite3.connect(":memory:")
    >>> _ = db.execute("CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INT, version INT)")
    >>> for qty, version in [(5, 2), (9, 1), (5, 2), (7, 3)]:  # late, duplicate, newer
    ...     event = {"sku": "A1", "qty": qty, "version": version}
    ...     _ = apply_if_newer(db, "stock", event, key="sku")
    >>> db.execute("SELECT qty, version FROM stock").fetchall()
    [(7, 3)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._writes import plan
from ._writes.faces import face
from .errors import VersionConflictError

__all__ = [
    "Upserted",
    "VersionConflictError",
    "aapply_if_newer",
    "acreate_once",
    "apply_if_newer",
    "aupdate_if_version",
    "create_once",
    "update_if_version",
]

Columns = str | Sequence[str]


@dataclass(frozen=True, slots=True)
class Upserted:
    """What `create_once` found: the row (the ``returning`` columns, by name) and whether
    this call created it (False: it was there already, made by an earlier call)."""

    row: dict[str, Any]
    created: bool


def create_once(
    conn: Any,
    table: Any,
    values: Mapping[str, Any],
    *,
    key: Columns,
    update: Columns = (),
    returning: Columns | None = None,
) -> Upserted:
    """Insert ``values`` unless a row with the same ``key`` exists; return the row either way.

    ``key`` names the columns of a natural (or derived, e.g. `idempo.derive_key`) key with a
    unique constraint or primary key on exactly them. With ``update`` (columns of
    ``values``), an existing row gets those columns overwritten: a deterministic upsert,
    whose outcome is the same however often it runs. ``returning`` names the columns to read
    back (default: those of ``values``; every column of a SQLAlchemy ``Table``).

    Runs in the caller's transaction and does not commit. On PostgreSQL under REPEATABLE READ
    or SERIALIZABLE, a key another transaction created after this one's snapshot raises the
    driver's serialization failure: retry the transaction. On MariaDB the key should be the
    table's only unique key (``ON DUPLICATE KEY UPDATE`` takes the first that collides), and
    over a connection with CLIENT_FOUND_ROWS (SQLAlchemy's) an ``update`` that changes
    nothing reads as created.

        >>> import sqlite3
        >>> db = sqlite3.connect(":memory:")
        >>> _ = db.execute("CREATE TABLE users (email TEXT PRIMARY KEY, name TEXT)")
        >>> create_once(db, "users", {"email": "a@x.io", "name": "Ann"}, key="email")
        Upserted(row={'email': 'a@x.io', 'name': 'Ann'}, created=True)
        >>> create_once(db, "users", {"email": "a@x.io", "name": "Bob"}, key="email")
        Upserted(row={'email': 'a@x.io', 'name': 'Ann'}, created=False)
    """
    on = face(conn, asynchronous=False)
    op = plan.CreateOnce.checked(values, key, update, _returning(table, returning))
    target = on.target(table, op.columns())
    return Upserted(*on.run(plan.create_once(target, op), target))


def update_if_version(
    conn: Any,
    table: Any,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    *,
    expected: int,
    version: str = "version",
) -> int:
    """Set ``values`` on the row named by ``key`` only if its ``version`` column still holds
    ``expected``, and move it to ``expected + 1``; return the new version.

    When no row matched (another writer moved the version first, or the row is gone), raise
    `VersionConflictError` (``actual``: the row's latest version, or None): nothing
    was changed. Retry by reading the row again in a *new* transaction (under REPEATABLE READ
    the same transaction would read the same stale version). Runs in the caller's
    transaction and does not commit. Write absolute values (``{"balance": 120}``), computed
    from what was read at ``expected``: the guard is what makes that safe.

        >>> import sqlite3
        >>> db = sqlite3.connect(":memory:")
        >>> _ = db.execute("CREATE TABLE acct (id INT PRIMARY KEY, balance INT, version INT)")
        >>> _ = db.execute("INSERT INTO acct VALUES (1, 100, 1)")
        >>> update_if_version(db, "acct", {"id": 1}, {"balance": 120}, expected=1)
        2
        >>> update_if_version(db, "acct", {"id": 1}, {"balance": 90}, expected=1)
        Traceback (most recent call last):
        ...
        idempo.errors.VersionConflictError: acct {'id': 1}: expected version 1, found version 2
    """
    on = face(conn, asynchronous=False)
    op = plan.VersionUpdate.checked(key, values, expected, version)
    target = on.target(table, op.columns())
    return on.run(plan.update_if_version(target, op), target)


def apply_if_newer(
    conn: Any,
    table: Any,
    values: Mapping[str, Any],
    *,
    key: Columns,
    version: str = "version",
) -> bool:
    """Write the event ``values`` (a whole row: its ``key`` columns, its ``version`` and the
    state it sets) only if its version is greater than the stored row's, or there is no row;
    in one statement. Return whether it wrote.

    An equal version is a duplicate and is skipped; so is an older one (a late delivery).
    The version may be a number or a timestamp; it must be NOT NULL and grow with each
    distinct event of a key (two different events with one version: the first kept wins).
    Values are absolute: the event carries the new state, never a delta. Runs in the
    caller's transaction and does not commit. On MariaDB over a connection with
    CLIENT_FOUND_ROWS (SQLAlchemy's default; ``connect_args={"client_flag": 0}`` turns it
    off), a duplicate of the event the row already holds returns True; the row is right
    either way.

        >>> import sqlite3
        >>> db = sqlite3.connect(":memory:")
        >>> _ = db.execute("CREATE TABLE price (sku TEXT PRIMARY KEY, cents INT, version INT)")
        >>> apply_if_newer(db, "price", {"sku": "A", "cents": 990, "version": 2}, key="sku")
        True
        >>> apply_if_newer(db, "price", {"sku": "A", "cents": 950, "version": 1}, key="sku")
        False
    """
    on = face(conn, asynchronous=False)
    op = plan.ApplyIfNewer.checked(values, key, version)
    target = on.target(table, op.columns())
    return on.run(plan.apply_if_newer(target, op), target)


async def acreate_once(
    conn: Any,
    table: Any,
    values: Mapping[str, Any],
    *,
    key: Columns,
    update: Columns = (),
    returning: Columns | None = None,
) -> Upserted:
    """`create_once` on an asynchronous connection (psycopg ``AsyncConnection``, SQLAlchemy
    ``AsyncConnection`` or ``AsyncSession``): the same statements, awaited."""
    on = face(conn, asynchronous=True)
    op = plan.CreateOnce.checked(values, key, update, _returning(table, returning))
    target = on.target(table, op.columns())
    return Upserted(*await on.arun(plan.create_once(target, op), target))


async def aupdate_if_version(
    conn: Any,
    table: Any,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    *,
    expected: int,
    version: str = "version",
) -> int:
    """`update_if_version` on an asynchronous connection: the same statement, awaited."""
    on = face(conn, asynchronous=True)
    op = plan.VersionUpdate.checked(key, values, expected, version)
    target = on.target(table, op.columns())
    return await on.arun(plan.update_if_version(target, op), target)


async def aapply_if_newer(
    conn: Any,
    table: Any,
    values: Mapping[str, Any],
    *,
    key: Columns,
    version: str = "version",
) -> bool:
    """`apply_if_newer` on an asynchronous connection: the same statement, awaited."""
    on = face(conn, asynchronous=True)
    op = plan.ApplyIfNewer.checked(values, key, version)
    target = on.target(table, op.columns())
    return await on.arun(plan.apply_if_newer(target, op), target)


def _returning(table: Any, returning: Columns | None) -> Columns | None:
    """What a create-once reads back when the caller named nothing: every column of a
    SQLAlchemy ``Table``; for a table by name, the columns written (None)."""
    if returning is not None or isinstance(table, str):
        return returning
    columns = getattr(table, "c", None)
    return None if columns is None else [column.name for column in columns]
