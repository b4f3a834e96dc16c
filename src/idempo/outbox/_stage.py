"""Staging: a message inserted on the app's connection, in the guard's transaction.

The INSERT is built once (`OutboxSql.stage`, sans I/O) and run by the executor the stores
already have for that kind of connection (psycopg, sqlite3, PyMySQL, aiomysql, SQLAlchemy;
sync or async), so it shares the transaction that carries the business writes and the
stored result: all three commit together, or none does.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

from .._core.keys import Scope, derive_key
from ..errors import ConfigurationError
from ..guard import Attempt
from ..policy import Policy
from ..stores._sql.dialect import SqlGen, Statement
from ..stores._sql.transaction import aexecute, execute
from ._message import OutboxMessage
from ._sql import DEFAULT_TABLE, OutboxSql

__all__ = ["Outbox", "astage", "encode_body", "message_id", "stage"]


def message_id(scope: Scope, label: str) -> str:
    """The id of the message ``label`` staged under ``scope``: deterministic, so every
    re-execution of the handler stages the same ids, and distinct per principal and
    operation even where two scopes share a key.

    >>> from idempo import Scope
    >>> message_id(Scope.of("k-1", operation="pay"), "payments#0")
    '3ee11c15-b8bb-53a0-845d-5ccafd470f7d'
    """
    return derive_key(scope.key, f"outbox|{scope.principal}|{scope.operation}|{label}")


def encode_body(body: Any) -> bytes:
    """A message body as bytes: bytes as they are, a str as UTF-8, anything else as compact
    JSON (UTF-8, keys in the order given).

    >>> encode_body({"id": 7, "amount": 500})
    b'{"id":7,"amount":500}'
    """
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    if isinstance(body, str):
        return body.encode()
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"cannot stage a body of type {type(body).__name__}: give bytes, a str or"
            f" JSON-able data ({exc})"
        ) from exc


@dataclass
class _Staged:
    """What one attempt staged so far: the count behind default labels, and the ids."""

    count: int = 0
    ids: set[str] = field(default_factory=set)


def _default_label(attempt: Any, destination: str, staged: _Staged) -> str:
    """``f"{destination}#{n}"``, n counting what the attempt staged; after a recorded step
    (recovery points: leased work whose steps commit one by one) also that step's name, so
    that a message a later step stages never takes the id of one an earlier step committed
    (a takeover resumes after that step, and counts from 0 again)."""
    label = f"{destination}#{staged.count}"
    point = getattr(attempt, "recovery_point", None)
    return label if point is None else f"{label}@{point}"


# Per attempt, for as long as the attempt lives (it is a plain object the guard made).
_staged: weakref.WeakKeyDictionary[Any, _Staged] = weakref.WeakKeyDictionary()
_staged_lock = threading.Lock()


def _family(conn: Any) -> str:
    """Which driver ``conn`` belongs to, by the modules of its classes (so a subclass, such
    as a pool's, is known too), without importing any driver."""
    for kind in type(conn).__mro__:
        module = kind.__module__
        if module.startswith("sqlalchemy.ext.asyncio"):
            return "sqlalchemy-async"
        for name in ("sqlalchemy", "psycopg", "pymysql", "aiomysql", "sqlite3"):
            if module == name or module.startswith(name + "."):
                return name
    return type(conn).__module__ + "." + type(conn).__qualname__


def _in_transaction(family: str, conn: Any) -> bool:
    if family == "sqlite3":
        return bool(conn.in_transaction)
    if family == "psycopg":
        from psycopg.pq import TransactionStatus  # noqa: PLC0415 - the app's driver

        status = conn.info.transaction_status
        return bool(status in (TransactionStatus.INTRANS, TransactionStatus.INERROR))
    if family == "pymysql":
        from ..stores.mysql import _in_transaction as in_trans  # noqa: PLC0415

        return in_trans(conn)
    if family == "aiomysql":
        return bool(conn.get_transaction_status())
    return bool(conn.in_transaction())  # SQLAlchemy, either face


def _sqlalchemy_dialect(conn: Any) -> str:
    sync = getattr(conn, "sync_session", None) or getattr(conn, "sync_connection", None) or conn
    bind = sync.get_bind() if hasattr(sync, "get_bind") else sync
    name = str(bind.dialect.name)
    return "mysql" if name == "mariadb" else name


def _no_store(gen: SqlGen[Any]) -> Any:
    raise AssertionError("staging runs nothing on the store's own connection")


def _runner(conn: Any) -> tuple[str, bool, Callable[[SqlGen[Any]], Any]]:
    """The database of ``conn``, whether it is async, and what runs a statement generator
    on it (returning an awaitable for an async connection)."""
    family = _family(conn)
    if family == "sqlite3":
        from ..stores.sqlite import _Sqlite3Tx  # noqa: PLC0415 - drivers load on use

        return "sqlite", False, partial(execute, _Sqlite3Tx(conn, _no_store))
    if family == "psycopg":
        import psycopg  # noqa: PLC0415

        from ..stores import postgres  # noqa: PLC0415

        if isinstance(conn, psycopg.AsyncConnection):
            tx: Any = postgres._AsyncPsycopgTx(conn)
            return "postgresql", True, partial(aexecute, tx)
        return (
            "postgresql",
            False,
            partial(execute, postgres._PsycopgTx(conn)),
        )
    if family in ("pymysql", "aiomysql"):
        from ..stores import mysql  # noqa: PLC0415

        if family == "aiomysql":
            return "mysql", True, partial(aexecute, mysql._AioMySQLTx(conn, _no_store, app=True))
        return "mysql", False, partial(execute, mysql._PyMySQLTx(conn, _no_store, app=True))
    if family in ("sqlalchemy", "sqlalchemy-async"):
        from ..stores._sql import sqlalchemy as sa  # noqa: PLC0415

        name = _sqlalchemy_dialect(conn)
        sql = (
            OutboxSql.of(name, DEFAULT_TABLE) if name in ("postgresql", "sqlite", "mysql") else None
        )
        if sql is None:
            raise ConfigurationError(
                f"cannot stage on a SQLAlchemy connection to {name!r}: the outbox runs on"
                " PostgreSQL, SQLite and MariaDB"
            )
        map_error = _map_error(name)
        if family == "sqlalchemy-async":
            atx = sa.AsyncSqlAlchemyTx(conn, sql.dialect, _no_store, map_error)
            return name, True, atx.run
        stx = sa.SqlAlchemyTx(conn, sql.dialect, _no_store, map_error)
        return name, False, stx.run
    raise ConfigurationError(
        f"cannot stage on a {family}: give the connection the guard runs on (psycopg,"
        " sqlite3, PyMySQL, aiomysql, or a SQLAlchemy session or connection)"
    )


def _map_error(name: str) -> Callable[[BaseException], BaseException]:
    """The driver's errors as idempo's, for a SQLAlchemy connection to database ``name``."""
    try:
        if name == "postgresql":
            from ..stores.postgres import map_error  # noqa: PLC0415
        elif name == "mysql":
            from ..stores.mysql import map_error  # noqa: PLC0415
        else:
            from ..stores.sqlite import map_error  # noqa: PLC0415
    except ConfigurationError:  # another driver behind SQLAlchemy (asyncpg, say)
        return _as_is
    return map_error


def _as_is(exc: BaseException) -> BaseException:
    return exc


class Outbox:
    """Stages messages in an outbox table; the relay (`idempo.outbox.Relay`) publishes them.

    Args:
        table: the outbox table (``schema.table`` allowed), ``idempo_outbox`` by default;
            `outbox_table` gives the one beside a records table. Create it with
            ``idempo migrate`` or `migrate`.
        policy: where its clock is injected (tests), ``created_at`` and the first
            ``available_at`` come from it; by default the database's clock.

    The module's `stage` and `astage` are those of ``Outbox()``.

    >>> Outbox("app.idempo_outbox").table
    'app.idempo_outbox'
    """

    def __init__(self, table: str = DEFAULT_TABLE, *, policy: Policy | None = None) -> None:
        OutboxSql.of("postgresql", table)  # validates the name
        self.table = table
        self.policy = policy or Policy()

    def sql(self, name: str) -> OutboxSql:
        """The statements for this table on database ``name``."""
        return OutboxSql.of(name, self.table)

    def _prepare(
        self,
        conn: Any,
        attempt: Attempt[Any],
        destination: str,
        body: Any,
        label: str | None,
        headers: Mapping[str, str] | None,
        *,
        asynchronous: bool,
    ) -> tuple[OutboxMessage, Any]:
        """Check everything, derive the id and run the INSERT (an awaitable when
        ``asynchronous``): what `stage` and `astage` share."""
        if conn is None:
            raise ConfigurationError(
                "stage() needs the connection the guard runs on (conn=...): a message staged"
                " elsewhere would not commit with the record"
            )
        if (
            getattr(attempt, "replayed", None) is not False
            or getattr(attempt, "scope", None) is None
        ):
            raise ConfigurationError(
                "stage() takes the attempt of a guarded block that executes; this one is a"
                " replay (its messages were staged by the first execution) or not an attempt"
            )
        # An attempt that knows its connection (``attempt.conn``) is held to it: a message
        # staged on another connection would commit apart from the record.
        if hasattr(attempt, "conn") and attempt.conn is not conn:
            raise ConfigurationError(
                "stage() was given another connection than the one the guard runs on"
                if attempt.conn is not None
                else "stage() needs a guarded call on a connection (conn=...): this attempt"
                " has none, so its messages could not commit with its record"
            )
        if not isinstance(destination, str) or not destination:
            raise ConfigurationError("a message's destination must be a non-empty string")
        if label is not None and (not isinstance(label, str) or not label):
            raise ConfigurationError("a message's label must be a non-empty string")
        extra = dict(headers or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
            raise ConfigurationError("a message's headers must map strings to strings")
        payload = encode_body(body)
        name, is_async, run = _runner(conn)
        if is_async != asynchronous:
            use = "await astage(...)" if is_async else "stage(...)"
            raise ConfigurationError(
                f"{type(conn).__name__} is {'an async' if is_async else 'a sync'} connection:"
                f" use {use}"
            )
        family = _family(conn)
        if not _in_transaction(family, conn):
            raise ConfigurationError(
                "stage() must run inside the guarded block, on its connection: this"
                " connection has no open transaction (conn= given to the guard?)"
            )
        scope = attempt.scope
        with _staged_lock:
            staged = _staged.setdefault(attempt, _Staged())
            chosen = label if label is not None else _default_label(attempt, destination, staged)
            ident = message_id(scope, chosen)
            if ident in staged.ids:
                raise ConfigurationError(
                    f"this attempt staged a message labelled {chosen!r} already: labels"
                    " name one message each"
                )
            staged.ids.add(ident)
            staged.count += 1
        message = OutboxMessage(ident, destination, payload, extra, 0)
        return message, run(self.sql(name).stage(message, scope, chosen, self.policy.now()))

    def stage(
        self,
        conn: Any,
        attempt: Attempt[Any],
        destination: str,
        body: Any,
        *,
        label: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> OutboxMessage:
        """Stage a message on ``conn`` in the guard's transaction: it commits with the
        block's writes and its stored result, and the relay publishes it after.

        Args:
            conn: the connection the guard runs on (``idem.once(..., conn=conn)``; the
                middleware's ``idempotent_connection``; a consumer's ``delivery.conn``).
            attempt: the block's attempt, not a replay.
            destination: where the publisher sends it (an exchange/routing key, a subject,
                a stream).
            body: bytes, a str (UTF-8) or JSON-able data (compact JSON).
            label: names the message within the attempt, for its id; by default
                ``f"{destination}#{n}"``, n counting the messages the attempt staged.
            headers: extra headers (strings), published with it.

        Returns the message with its id (the downstream dedupe key, the same on every
        re-execution).

        Raises:
            ConfigurationError: no connection, a replayed attempt, an async connection
                (use `astage`), a connection outside the guard's transaction, bad arguments.
            StoreError: the INSERT failed (the table is missing: ``idempo migrate``).
        """
        message, _ = self._prepare(
            conn, attempt, destination, body, label, headers, asynchronous=False
        )
        return message

    async def astage(
        self,
        conn: Any,
        attempt: Attempt[Any],
        destination: str,
        body: Any,
        *,
        label: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> OutboxMessage:
        """The asynchronous face of `stage`, for psycopg's ``AsyncConnection``, aiomysql
        and SQLAlchemy's ``AsyncSession`` / ``AsyncConnection``."""
        message, pending = self._prepare(
            conn, attempt, destination, body, label, headers, asynchronous=True
        )
        done: Awaitable[Any] = pending
        await done
        return message

    # -- the table ------------------------------------------------------------------------
    def migrate(self, store: Any) -> None:
        """Create the outbox table and its indexes with a SQL store (``store.run``); safe to
        run again."""
        for gen in self._ddl(store):
            store.run(gen)

    async def amigrate(self, store: Any) -> None:
        """The asynchronous face of `migrate`, with an async SQL store."""
        for gen in self._ddl(store):
            await store.run(gen)

    def purge(
        self, store: Any, *, retention: timedelta = timedelta(days=1), limit: int = 1000
    ) -> int:
        """Delete up to ``limit`` messages sent more than ``retention`` ago (the store's
        clock); how many. Pending messages stay, however old."""
        return int(store.run(self._sql_of(store).purge(retention, limit, self.policy.now())))

    def stats(self, store: Any) -> dict[str, int]:
        """The backlog: ``pending``, ``failing`` (pending, tried before), ``sent``."""
        # A store that reads without locking (SQLite's, also read-only) reads so here.
        read = getattr(store, "read", store.run)
        result: dict[str, int] = read(self._sql_of(store).stats())
        return result

    def _sql_of(self, store: Any) -> OutboxSql:
        dialect = getattr(store, "dialect", None)
        if dialect is None:
            raise ConfigurationError(
                f"{type(store).__name__} keeps no SQL tables: the outbox needs a SQL store"
            )
        return self.sql(dialect.name)

    def _ddl(self, store: Any) -> list[SqlGen[None]]:
        return [_statement(sql) for sql in self._sql_of(store).ddl()]


def _statement(sql: str) -> SqlGen[None]:
    yield Statement(sql, {}, fetch=False)


_default = Outbox()


def stage(
    conn: Any,
    attempt: Attempt[Any],
    destination: str,
    body: Any,
    *,
    label: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> OutboxMessage:
    """`Outbox.stage` on the default table, ``idempo_outbox``.

    with idem.once(key, operation="capture", payload=order, conn=conn) as attempt:
        if not attempt.replayed:
            conn.execute("UPDATE payments SET captured = true WHERE id = ?", (order["id"],))
            stage(conn, attempt, "payments", {"event": "payment.captured", "id": order["id"]})
            attempt.result = {"captured": order["id"]}
    """
    return _default.stage(conn, attempt, destination, body, label=label, headers=headers)


async def astage(
    conn: Any,
    attempt: Attempt[Any],
    destination: str,
    body: Any,
    *,
    label: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> OutboxMessage:
    """`Outbox.astage` on the default table, ``idempo_outbox``."""
    return await _default.astage(conn, attempt, destination, body, label=label, headers=headers)
