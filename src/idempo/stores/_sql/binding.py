"""Which connections a SQL store's ``bind`` can run on: its driver's own, or a SQLAlchemy
session or connection of the same face (sync or async). Anything else is refused here, with a
`ConfigurationError` that names what the store takes, before anything runs on it.

    conn = sqlalchemy_connection(conn, asynchronous=False, store="PostgresStore",
                                 driver="a psycopg.Connection")
"""

from __future__ import annotations

from typing import Any

from ...errors import ConfigurationError

_ASYNC_SQLALCHEMY = "sqlalchemy.ext.asyncio"


def sqlalchemy_connection(conn: Any, *, asynchronous: bool, store: str, driver: str | None) -> Any:
    """``conn`` when it is a SQLAlchemy session or connection of the store's face; else
    `ConfigurationError` naming the kinds of connection ``store`` takes (``driver``: its
    driver's own). Told by the class's module, so SQLAlchemy is never imported for it."""
    module = type(conn).__module__
    ours = module == "sqlalchemy" or module.startswith("sqlalchemy.")
    if ours and module.startswith(_ASYNC_SQLALCHEMY) == asynchronous:
        return conn
    takes = "a SQLAlchemy " + (
        "AsyncSession or AsyncConnection" if asynchronous else "Session or Connection"
    )
    raise ConfigurationError(
        f"{store} cannot run a guarded call on a {module}.{type(conn).__qualname__}:"
        f" conn= takes {takes if driver is None else f'{driver} or {takes}'}"
    )
