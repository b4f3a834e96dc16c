"""SQL shared by the SQLite and PostgreSQL stores, written once and run by any executor.

Each verb is a generator that yields `Statement`s and receives their rows, so the same text
runs on the store's own connections (leased mode), on the app's psycopg or sqlite3
connection, or through SQLAlchemy, sync or async. Executors only execute; they never decide.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Generator
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any, NamedTuple, TypeVar

from .._keys import Scope
from .._ops import Release, Renew, Reserve, Settle
from .._record import Acquired, InProgress, Record, Reservation, Status, judge
from ..errors import ConfigurationError, FencedError

T = TypeVar("T")
Rows = list[tuple[Any, ...]]


class Statement(NamedTuple):
    """One SQL statement with ``:name`` parameters. ``fetch=False`` statements return nothing,
    so a pipelining executor may send them without waiting."""

    sql: str
    params: dict[str, Any]
    fetch: bool = True


SqlGen = Generator[Statement, Rows | None, T]

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$")
_NAMED_PARAM = re.compile(r"(?<!:):([a-z_]+)")

# A takeover after a lost race is retried a few times before the caller is told to come back.
_RESERVE_TRIES = 5
FENCED_MARKER = "idempo-fenced"


def pyformat(sql: str) -> str:
    """``:name`` placeholders as psycopg's ``%(name)s``."""
    return _NAMED_PARAM.sub(r"%(\1)s", sql.replace("%", "%%"))


def drive(gen: Generator[Any, Any, T], execute: Callable[[Any], Any]) -> T:
    """Run a generator of I/O operations to its result with a synchronous executor.

    A failed operation is thrown back into the generator, so its ``except`` clauses see it.
    """
    try:
        op = next(gen)
        while True:
            try:
                result = execute(op)
            except BaseException as exc:  # noqa: BLE001 - the generator decides
                op = gen.throw(exc)
            else:
                op = gen.send(result)
    except StopIteration as stop:
        value: T = stop.value
        return value


async def adrive(gen: Generator[Any, Any, T], execute: Callable[[Any], Awaitable[Any]]) -> T:
    """The asynchronous twin of `drive`."""
    try:
        op = next(gen)
        while True:
            try:
                result = await execute(op)
            except BaseException as exc:  # noqa: BLE001 - the generator decides
                op = gen.throw(exc)
            else:
                op = gen.send(result)
    except StopIteration as stop:
        value: T = stop.value
        return value


_COLUMNS = (
    "principal, operation, idem_key, fingerprint, state, token, lease_expires_at, response,"
    " created_at, updated_at, expires_at, recovery_point"
)
_WHERE_SCOPE = "principal = :principal AND operation = :operation AND idem_key = :key"


class SqlDialect:
    """The statements for one table; subclasses supply what differs between databases."""

    name: str

    def __init__(self, table: str) -> None:
        if not _IDENTIFIER.match(table):
            raise ConfigurationError(f"{table!r} is not a plain (optionally schema.) table name")
        self.table = table

    # -- what differs per database -------------------------------------------------------
    def db_time(self, value: datetime) -> Any:
        return value

    def py_time(self, value: Any) -> datetime:
        result: datetime = value
        return result

    def ddl(self) -> list[str]:
        raise NotImplementedError

    def reserve(self, op: Reserve) -> SqlGen[Reservation]:
        raise NotImplementedError

    def settle(self, op: Settle) -> SqlGen[None]:
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------
    def scope_params(self, scope: Scope) -> dict[str, Any]:
        return {"principal": scope.principal, "operation": scope.operation, "key": scope.key}

    def reserve_params(self, op: Reserve) -> dict[str, Any]:
        return {
            **self.scope_params(op.scope),
            "fingerprint": op.fingerprint,
            "now": self.db_time(op.now),
            "lease_until": self.db_time(op.now + op.lease),
            # Long enough that a completion within the lease need not move it (see settle).
            "expires_at": self.db_time(op.now + op.lease + op.ttl),
        }

    def settle_params(self, op: Settle) -> dict[str, Any]:
        return {
            **self.scope_params(op.scope),
            "token": op.token,
            "state": op.status.value,
            "response": op.response,
            "now": self.db_time(op.now),
            "expires_at": self.db_time(op.now + op.ttl),
        }

    @cached_property
    def insert_sql(self) -> str:
        return (
            f"INSERT INTO {self.table} AS r (principal, operation, idem_key, fingerprint, state,"
            " token, lease_expires_at, created_at, updated_at, expires_at)"
            " VALUES (:principal, :operation, :key, :fingerprint, 'in_progress', 1,"
            " :lease_until, :now, :now, :expires_at)"
            f" ON CONFLICT DO NOTHING RETURNING {_COLUMNS}"
        )

    @cached_property
    def takeover_sql(self) -> str:
        return self.takeover_where("")

    def takeover_where(self, condition: str) -> str:
        """The takeover UPDATE, with an extra ``condition AND`` in front of its WHERE clause."""
        # An expired record (retention over) is free for anyone; an expired lease only for a
        # retry of the same request. The token keeps growing either way, which fences out the
        # holder that lost the key.
        return (
            f"UPDATE {self.table} AS r SET fingerprint = :fingerprint, state = 'in_progress',"
            " token = r.token + 1, lease_expires_at = :lease_until, response = NULL,"
            " updated_at = :now, expires_at = :expires_at,"
            " created_at = CASE WHEN r.expires_at <= :now THEN :now ELSE r.created_at END,"
            " recovery_point = CASE WHEN r.expires_at <= :now THEN NULL"
            " ELSE r.recovery_point END"
            f" WHERE {condition}{_WHERE_SCOPE} AND (r.expires_at <= :now"
            " OR (r.state = 'in_progress' AND r.lease_expires_at <= :now"
            " AND r.fingerprint = :fingerprint))"
            f" RETURNING {_COLUMNS}"
        )

    @cached_property
    def select_sql(self) -> str:
        return f"SELECT {_COLUMNS} FROM {self.table} WHERE {_WHERE_SCOPE}"

    def record(self, row: tuple[Any, ...]) -> Record:
        (principal, operation, key, fp, state, token, lease, response, created, updated,
         expires, point) = row  # fmt: skip
        return Record(
            scope=Scope(principal, operation, key),
            fingerprint=fp,
            status=Status(state),
            token=int(token),
            lease_expires_at=None if lease is None else self.py_time(lease),
            response=None if response is None else bytes(response),
            created_at=self.py_time(created),
            updated_at=self.py_time(updated),
            expires_at=self.py_time(expires),
            recovery_point=point,
        )

    def release(self, op: Release) -> SqlGen[None]:
        yield Statement(
            f"DELETE FROM {self.table} WHERE {_WHERE_SCOPE}"
            " AND token = :token AND state = 'in_progress'",
            {**self.scope_params(op.scope), "token": op.token},
            fetch=False,
        )

    def renew(self, op: Renew) -> SqlGen[None]:
        rows = yield Statement(
            f"UPDATE {self.table} SET lease_expires_at = :until, updated_at = :now,"
            " expires_at = CASE WHEN expires_at < :until THEN :until ELSE expires_at END"
            f" WHERE {_WHERE_SCOPE} AND token = :token AND state = 'in_progress'"
            " RETURNING token",
            {
                **self.scope_params(op.scope),
                "token": op.token,
                "now": self.db_time(op.now),
                "until": self.db_time(op.now + op.lease),
            },
        )
        if not rows:
            raise FencedError(f"cannot renew key {op.scope.key!r}: token {op.token} is stale")

    def get(self, scope: Scope) -> SqlGen[Record | None]:
        rows = yield Statement(self.select_sql, self.scope_params(scope))
        return self.record(rows[0]) if rows else None

    def purge(self, before: datetime, limit: int) -> SqlGen[int]:
        # Bounded batches keep each delete short; a live lease is never purged.
        rows = yield Statement(
            f"DELETE FROM {self.table} WHERE (principal, operation, idem_key) IN ("
            f" SELECT principal, operation, idem_key FROM {self.table}"
            " WHERE expires_at <= :before"
            " AND (state <> 'in_progress' OR lease_expires_at <= :before) LIMIT :limit)"
            " RETURNING 1",
            {"before": self.db_time(before), "limit": limit},
        )
        return len(rows or ())

    def stats(self) -> SqlGen[dict[str, int]]:
        rows = yield Statement(f"SELECT state, count(*) FROM {self.table} GROUP BY state", {})
        return {str(state): int(count) for state, count in rows or ()}

    def judge_rows(self, rows: Rows | None, fingerprint: str, now: datetime) -> Reservation | None:
        """Decode a reservation statement's row: acquired, or what the record means."""
        if not rows:
            return None
        row = rows[0]
        if row[0]:
            return Acquired(token=int(row[6]), recovery_point=row[12])
        return judge(self.record(row[1:]), fingerprint, now)


class PostgresDialect(SqlDialect):
    """PostgreSQL: reservation, takeover and the fallback read are one statement."""

    name = "postgresql"

    def py_time(self, value: Any) -> datetime:
        # timestamptz comes back in the session's TimeZone; a record's times are UTC.
        result: datetime = value.astimezone(UTC)
        return result

    def ddl(self) -> list[str]:
        index = self.table.replace(".", "_") + "_expires_at"
        return [
            f"CREATE TABLE IF NOT EXISTS {self.table} ("
            " principal text NOT NULL, operation text NOT NULL, idem_key text NOT NULL,"
            " fingerprint text NOT NULL, state text NOT NULL, token bigint NOT NULL,"
            " lease_expires_at timestamptz, response bytea,"
            " created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL,"
            " expires_at timestamptz NOT NULL, recovery_point text,"
            " PRIMARY KEY (principal, operation, idem_key))"
            # Room on each page for the one in-place update a record gets when it completes.
            " WITH (fillfactor = 80)",
            f"CREATE INDEX IF NOT EXISTS {index.rsplit('.', 1)[-1]} ON {self.table} (expires_at)",
        ]

    @cached_property
    def reserve_sql(self) -> str:
        # One round trip for every case, and one index lookup for a replay: the insert and
        # the takeover only run when what the first read found calls for them (their guards
        # do not depend on the row, so PostgreSQL checks them once, before any scan). All
        # parts see the snapshot taken when the statement started, so a duplicate that
        # committed while we waited on its row is invisible here: then no row comes back and
        # the caller simply asks again.
        takeover_allowed = (
            "EXISTS (SELECT 1 FROM existing e WHERE e.expires_at <= :now"
            " OR (e.state = 'in_progress' AND e.lease_expires_at <= :now"
            " AND e.fingerprint = :fingerprint)) AND "
        )
        insert = self.insert_sql.replace(" VALUES (", " SELECT ", 1).replace(
            " :expires_at)", " :expires_at WHERE NOT EXISTS (SELECT 1 FROM existing)", 1
        )
        return (
            f"WITH existing AS ({self.select_sql}),"
            f" inserted AS ({insert}),"
            f" taken AS ({self.takeover_where(takeover_allowed)})"
            f" SELECT true, {_COLUMNS} FROM inserted"
            f" UNION ALL SELECT true, {_COLUMNS} FROM taken"
            f" UNION ALL SELECT false, {_COLUMNS} FROM existing"
            " WHERE NOT EXISTS (SELECT 1 FROM inserted) AND NOT EXISTS (SELECT 1 FROM taken)"
        )

    def reserve(self, op: Reserve) -> SqlGen[Reservation]:
        params = self.reserve_params(op)
        for _ in range(_RESERVE_TRIES):
            rows = yield Statement(self.reserve_sql, params)
            reservation = self.judge_rows(rows, op.fingerprint, op.now)
            if reservation is not None:
                return reservation
        return InProgress(retry_after=min(op.lease.total_seconds(), 1.0))

    @cached_property
    def settle_sql(self) -> str:
        # A stale token must abort the transaction it runs in, even when COMMIT was pipelined
        # right behind it; SQL has no RAISE, so a failing cast carries the error.
        return (
            f"WITH settled AS (UPDATE {self.table} SET state = :state, response = :response,"
            " lease_expires_at = NULL, updated_at = :now,"
            # Retention is at least ttl after completion. Leaving expires_at as it is when that
            # already holds changes no indexed column, so PostgreSQL can update in place (HOT).
            " expires_at = CASE WHEN expires_at < :expires_at THEN :expires_at"
            " ELSE expires_at END"
            f" WHERE {_WHERE_SCOPE} AND token = :token AND state = 'in_progress'"
            " RETURNING token)"
            " SELECT CASE WHEN EXISTS (SELECT 1 FROM settled) THEN 1"
            f" ELSE CAST(concat('{FENCED_MARKER}: stale token for key ', :key) AS integer) END"
        )

    def settle(self, op: Settle) -> SqlGen[None]:
        yield Statement(self.settle_sql, self.settle_params(op), fetch=False)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class SQLiteDialect(SqlDialect):
    """SQLite: the same steps as separate statements inside one write transaction.

    Times are integer microseconds since the epoch, so comparisons are exact.
    """

    name = "sqlite"

    def db_time(self, value: datetime) -> Any:
        return (value - _EPOCH) // timedelta(microseconds=1)

    def py_time(self, value: Any) -> datetime:
        return _EPOCH + timedelta(microseconds=int(value))

    def ddl(self) -> list[str]:
        return [
            f"CREATE TABLE IF NOT EXISTS {self.table} ("
            " principal TEXT NOT NULL, operation TEXT NOT NULL, idem_key TEXT NOT NULL,"
            " fingerprint TEXT NOT NULL, state TEXT NOT NULL, token INTEGER NOT NULL,"
            " lease_expires_at INTEGER, response BLOB,"
            " created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,"
            " expires_at INTEGER NOT NULL, recovery_point TEXT,"
            " PRIMARY KEY (principal, operation, idem_key)) WITHOUT ROWID",
            f"CREATE INDEX IF NOT EXISTS {self.table}_expires_at ON {self.table} (expires_at)",
        ]

    @cached_property
    def sqlite_insert_sql(self) -> str:
        return self.insert_sql.replace(f"INTO {self.table} AS r", f"INTO {self.table}")

    def reserve(self, op: Reserve) -> SqlGen[Reservation]:
        # Callers run this inside one write transaction, so the three steps are atomic.
        params = self.reserve_params(op)
        rows = yield Statement(self.sqlite_insert_sql, params)
        if not rows:
            rows = yield Statement(self.takeover_sql, params)
        if rows:
            return Acquired(token=int(rows[0][5]), recovery_point=rows[0][11])
        rows = yield Statement(self.select_sql, self.scope_params(op.scope))
        if not rows:
            return InProgress(retry_after=min(op.lease.total_seconds(), 1.0))
        return judge(self.record(rows[0]), op.fingerprint, op.now) or InProgress(retry_after=0.0)

    def settle(self, op: Settle) -> SqlGen[None]:
        rows = yield Statement(
            f"UPDATE {self.table} SET state = :state, response = :response,"
            " lease_expires_at = NULL, updated_at = :now,"
            # Retention is at least ttl after completion. Leaving expires_at as it is when that
            # already holds changes no indexed column, so PostgreSQL can update in place (HOT).
            " expires_at = CASE WHEN expires_at < :expires_at THEN :expires_at"
            " ELSE expires_at END"
            f" WHERE {_WHERE_SCOPE} AND token = :token AND state = 'in_progress'"
            " RETURNING token",
            self.settle_params(op),
        )
        if not rows:
            raise FencedError(f"cannot settle key {op.scope.key!r}: token {op.token} is stale")
