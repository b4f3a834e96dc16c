"""SQL shared by the SQLite and PostgreSQL stores, written once and run by any executor.

Each verb is a generator that yields `Statement`s and receives their rows, so the same text
runs on the store's own connections (leased mode), on the app's psycopg or sqlite3
connection, or through SQLAlchemy, sync or async. Executors only execute; they never decide.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable, Generator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any, NamedTuple, TypeVar

from .._core.keys import Scope
from .._core.ops import Release, Renew, Reserve, Settle
from .._core.record import Acquired, InProgress, Record, Reservation, Status, judge
from .._http import evict_hint
from ..errors import ConfigurationError, CorruptRecordError, FencedError
from . import _clock

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
# PostgreSQL keeps 63 bytes of a name and cuts the rest silently (MariaDB refuses past 64).
_MAX_NAME = 63

OpT = TypeVar("OpT", Reserve, Settle, Renew)


def derived_name(table: str, suffix: str) -> str:
    """The name of a schema object that belongs to ``table``, in the table's schema.

    >>> derived_name("app.idempo_records", "tokens")
    'app.idempo_records_tokens'

    A name that would pass 63 characters is shortened and made unique with a digest, so
    PostgreSQL's silent cut cannot land it on another object (the table itself, say).
    """
    schema, dot, name = table.rpartition(".")
    derived = f"{name}_{suffix}"
    if len(derived) > _MAX_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        derived = f"{name[: _MAX_NAME - len(suffix) - 10]}_{digest}_{suffix}"
    return f"{schema}{dot}{derived}"


def corrupt(scope: Scope, why: str) -> CorruptRecordError:
    """The error for a stored record the store cannot decode: nothing runs, nothing is
    replayed, and the message says how to get rid of it."""
    return CorruptRecordError(
        f"the stored record of key {scope.key!r} (operation {scope.operation!r}, principal"
        f" {scope.principal!r}) cannot be decoded ({why}); nothing was run or replayed."
        f" Evict it: {evict_hint(scope)} (or store.evict(scope))"
    )


class SqlDialect:
    """The statements for one table; subclasses supply what differs between databases.

    **Time.** A verb's ``now`` (a purge's ``before``) is a parameter when the caller injected
    a time; when it is None the statement reads the server's clock (`server_clock`), and
    every later time in the statement (lease end, expiry) is that value plus a duration, so
    one statement decides on one instant. The reservation returns the instant it decided at,
    which is what the record is judged against. SQLite has no server clock: its caller's
    ``now`` is fixed to the host's first (`fix_now`).

    **Tokens.** Fresh tokens come from a counter shared by the whole table that never goes
    back (`next_token`: a sequence, or SQLite's counter row), and a takeover's token is the
    larger of the old token plus one and the counter's next value. So a scope's tokens only
    grow even when its record is deleted and made again (purge, expiry, `evict`): a holder
    stalled past all that never matches a later holder (SPEC §2 rule 8).
    """

    name: str
    greatest = "GREATEST"
    where_scope = _WHERE_SCOPE
    # The server's clock as SQL (the same value throughout one statement); "" for none.
    server_clock = ""

    def __init__(self, table: str) -> None:
        if not _IDENTIFIER.match(table):
            raise ConfigurationError(f"{table!r} is not a plain (optionally schema.) table name")
        self.table = table
        self.tokens = derived_name(table, "tokens")

    # -- what differs per database -------------------------------------------------------
    def db_time(self, value: datetime) -> Any:
        return value

    def db_span(self, value: timedelta) -> Any:
        """A duration as the statements' ``plus`` takes it: microseconds, by default."""
        return value // timedelta(microseconds=1)

    def py_time(self, value: Any) -> datetime:
        result: datetime = value
        return result

    def time_param(self, name: str) -> str:
        """The time parameter ``name``, or the server's clock where it is None."""
        if self.server_clock:
            return f"COALESCE({self.cast_time(name)}, {self.server_clock})"
        return f":{name}"

    def cast_time(self, name: str) -> str:
        return f":{name}"

    def plus(self, time: str, span: str) -> str:
        """SQL for the time expression ``time`` plus the duration parameter ``span``."""
        return f"({time} + :{span})"

    @property
    def next_token(self) -> str:
        """SQL for the counter's next value (a fresh reservation's token)."""
        raise NotImplementedError

    def ddl(self) -> list[str]:
        raise NotImplementedError

    def reserve(self, op: Reserve) -> SqlGen[Reservation]:
        raise NotImplementedError

    def settle(self, op: Settle) -> SqlGen[None]:
        raise NotImplementedError

    def fix_now(self, op: OpT) -> OpT:
        """``op`` as the statements take it: a store without a clock of its own decides on
        the host's (SPEC §2 rule 9); one with a clock reads it in the statement."""
        if op.now is not None or self.server_clock:
            return op
        return replace(op, now=_clock.host_now())

    # -- shared ---------------------------------------------------------------------------
    @cached_property
    def now(self) -> str:
        return self.time_param("now")

    def scope_params(self, scope: Scope) -> dict[str, Any]:
        return {"principal": scope.principal, "operation": scope.operation, "key": scope.key}

    def time_value(self, value: datetime | None) -> Any:
        return None if value is None else self.db_time(value)

    def reserve_params(self, op: Reserve) -> dict[str, Any]:
        return {
            **self.scope_params(op.scope),
            "fingerprint": op.fingerprint,
            "now": self.time_value(op.now),
            "lease": self.db_span(op.lease),
            # Long enough that a completion within the lease need not move it (see settle).
            "lease_ttl": self.db_span(op.lease + op.ttl),
        }

    def settle_params(self, op: Settle) -> dict[str, Any]:
        return {
            **self.scope_params(op.scope),
            "token": op.token,
            "state": op.status.value,
            "response": op.response,
            "now": self.time_value(op.now),
            "ttl": self.db_span(op.ttl),
        }

    @cached_property
    def insert_values(self) -> str:
        now = self.now
        return (
            f":principal, :operation, :key, :fingerprint, 'in_progress', {self.next_token},"
            f" {self.plus(now, 'lease')}, {now}, {now}, {self.plus(now, 'lease_ttl')}"
        )

    insert_columns = (
        "principal, operation, idem_key, fingerprint, state, token, lease_expires_at,"
        " created_at, updated_at, expires_at"
    )

    @cached_property
    def takeover_sql(self) -> str:
        return self.takeover_where("")

    def takeover_where(self, condition: str) -> str:
        """The takeover UPDATE, with an extra ``condition AND`` in front of its WHERE clause."""
        # An expired record (retention over) is free for anyone; an expired lease only for a
        # retry of the same request. The token keeps growing either way, which fences out the
        # holder that lost the key.
        now = self.now
        return (
            f"UPDATE {self.table} AS r SET fingerprint = :fingerprint, state = 'in_progress',"
            f" token = {self.greatest}(r.token + 1, {self.next_token}),"
            f" lease_expires_at = {self.plus(now, 'lease')}, response = NULL,"
            f" updated_at = {now}, expires_at = {self.plus(now, 'lease_ttl')},"
            f" created_at = CASE WHEN r.expires_at <= {now} THEN {now} ELSE r.created_at END,"
            f" recovery_point = CASE WHEN r.expires_at <= {now} THEN NULL"
            " ELSE r.recovery_point END"
            f" WHERE {condition}{_WHERE_SCOPE} AND (r.expires_at <= {now}"
            f" OR (r.state = 'in_progress' AND r.lease_expires_at <= {now}"
            " AND r.fingerprint = :fingerprint))"
            f" RETURNING {_COLUMNS}"
        )

    @cached_property
    def select_sql(self) -> str:
        return f"SELECT {_COLUMNS} FROM {self.table} WHERE {self.where_scope}"

    @cached_property
    def settle_update(self) -> str:
        """The fenced UPDATE that settles a reservation (no RETURNING)."""
        expires = self.plus(self.now, "ttl")
        return (
            f"UPDATE {self.table} SET state = :state, response = :response,"
            f" lease_expires_at = NULL, updated_at = {self.now},"
            # Retention is at least ttl after completion. Leaving expires_at as it is when that
            # already holds changes no indexed column, so PostgreSQL can update in place (HOT).
            f" expires_at = CASE WHEN expires_at < {expires} THEN {expires} ELSE expires_at END"
            f" WHERE {self.where_scope} AND token = :token AND state = 'in_progress'"
        )

    @cached_property
    def settled_sql(self) -> str:
        """Whether the record already holds this very outcome under this token."""
        return (
            f"SELECT 1 FROM {self.table} WHERE {self.where_scope}"
            " AND token = :token AND state = :state AND response = :response"
        )

    def settled_already(self, op: Settle) -> SqlGen[None]:
        """Nothing to do if the record holds exactly this outcome under this token (a retried
        settle whose answer was lost); `FencedError` otherwise."""
        rows = yield Statement(self.settled_sql, self.settle_params(op))
        if not rows:
            raise FencedError(f"cannot settle key {op.scope.key!r}: token {op.token} is stale")

    @cached_property
    def renew_update(self) -> str:
        until = self.plus(self.now, "lease")
        return (
            f"UPDATE {self.table} SET lease_expires_at = {until}, updated_at = {self.now},"
            f" expires_at = CASE WHEN expires_at < {until} THEN {until} ELSE expires_at END"
            f" WHERE {self.where_scope} AND token = :token AND state = 'in_progress'"
        )

    def renew_params(self, op: Renew) -> dict[str, Any]:
        return {
            **self.scope_params(op.scope),
            "token": op.token,
            "now": self.time_value(op.now),
            "lease": self.db_span(op.lease),
        }

    @cached_property
    def expired(self) -> str:
        """Which records purge may delete: retention over, and no live lease."""
        before = self.time_param("before")
        return (
            f"expires_at <= {before} AND (state <> 'in_progress' OR lease_expires_at <= {before})"
        )

    def purge_params(self, before: datetime | None, limit: int) -> dict[str, Any]:
        if before is None and not self.server_clock:
            before = _clock.host_now()
        return {"before": self.time_value(before), "limit": int(limit)}

    def record(self, row: tuple[Any, ...], asked: Scope | None = None) -> Record:
        """The record a row holds; `CorruptRecordError` if it holds something no store
        writes (another program's row, a hand edit), named by ``asked`` or its own scope."""
        (principal, operation, key, fp, state, token, lease, response, created, updated,
         expires, point) = row  # fmt: skip
        scope = Scope(principal, operation, key)
        try:
            if not isinstance(fp, str) or not (point is None or isinstance(point, str)):
                raise TypeError("the fingerprint or recovery point is not text")
            if isinstance(token, bool) or not isinstance(token, int) or token < 1:
                raise ValueError(f"token {token!r}")
            return Record(
                scope=scope,
                fingerprint=fp,
                status=Status(state),
                token=token,
                lease_expires_at=None if lease is None else self.py_time(lease),
                response=None if response is None else bytes(response),
                created_at=self.py_time(created),
                updated_at=self.py_time(updated),
                expires_at=self.py_time(expires),
                recovery_point=point,
            )
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            raise corrupt(asked or scope, f"{type(exc).__name__}: {exc}") from exc

    def release(self, op: Release) -> SqlGen[None]:
        yield Statement(
            f"DELETE FROM {self.table} WHERE {self.where_scope}"
            " AND token = :token AND state = 'in_progress'",
            {**self.scope_params(op.scope), "token": op.token},
            fetch=False,
        )

    def renew(self, op: Renew) -> SqlGen[None]:
        op = self.fix_now(op)
        rows = yield Statement(f"{self.renew_update} RETURNING token", self.renew_params(op))
        if not rows:
            raise FencedError(f"cannot renew key {op.scope.key!r}: token {op.token} is stale")

    def get(self, scope: Scope) -> SqlGen[Record | None]:
        rows = yield Statement(self.select_sql, self.scope_params(scope))
        return self.record(rows[0], scope) if rows else None

    # Rows a takeover in progress has locked are being made live: skip them, never wait.
    purge_lock = " FOR UPDATE SKIP LOCKED"

    def purge(self, before: datetime | None, limit: int) -> SqlGen[int]:
        # Bounded batches keep each delete short. The outer WHERE states the conditions
        # again: PostgreSQL (READ COMMITTED) re-checks only the outer clause on a row version
        # a takeover wrote after the subquery picked the row, and that clause must then
        # spare the fresh record (issue 10, #1).
        rows = yield Statement(
            f"DELETE FROM {self.table} WHERE (principal, operation, idem_key) IN ("
            f" SELECT principal, operation, idem_key FROM {self.table}"
            f" WHERE {self.expired} LIMIT :limit{self.purge_lock}) AND {self.expired}"
            " RETURNING 1",
            self.purge_params(before, limit),
        )
        return len(rows or ())

    def evict(self, scope: Scope) -> SqlGen[bool]:
        rows = yield Statement(
            f"DELETE FROM {self.table} WHERE {self.where_scope} RETURNING 1",
            self.scope_params(scope),
        )
        return bool(rows)

    def stats(self) -> SqlGen[dict[str, int]]:
        rows = yield Statement(f"SELECT state, count(*) FROM {self.table} GROUP BY state", {})
        return {str(state): int(count) for state, count in rows or ()}

    def judge_rows(self, rows: Rows | None, op: Reserve) -> Reservation | None:
        """Decode a reservation statement's row ``(acquired, *columns, decided_at)``:
        acquired, or what the record means at the instant the statement decided."""
        if not rows:
            return None
        row = rows[0]
        if row[0]:
            return Acquired(token=int(row[6]), recovery_point=row[12])
        return judge(self.record(row[1:-1], op.scope), op.fingerprint, self.py_time(row[-1]))


class PostgresDialect(SqlDialect):
    """PostgreSQL: reservation, takeover and the fallback read are one statement.

    The server's clock is ``statement_timestamp()``: constant through the statement (so its
    parts agree on one instant, unlike ``clock_timestamp()``) and taken when the statement
    arrives, not when the app's transaction began (``now()`` would be as old as a long
    transaction in transactional mode). A statement that waited on a row lock decides at
    its arrival: never later than the truth, so a lease is never cut short by the wait.
    """

    name = "postgresql"
    server_clock = "statement_timestamp()"

    def __init__(self, table: str) -> None:
        super().__init__(table)
        self.sequence = self.tokens

    def py_time(self, value: Any) -> datetime:
        # timestamptz comes back in the session's TimeZone; a record's times are UTC.
        result: datetime = value.astimezone(UTC)
        return result

    def db_span(self, value: timedelta) -> Any:
        return value

    def cast_time(self, name: str) -> str:
        return f"CAST(:{name} AS timestamptz)"

    def plus(self, time: str, span: str) -> str:
        return f"({time} + CAST(:{span} AS interval))"

    @property
    def next_token(self) -> str:
        # A missing sequence fails the statement, whatever path it takes, with the error a
        # missing table gives (UndefinedTable): the store maps it to SchemaMissingError.
        return f"nextval('{self.sequence}')"

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
            # The token sequence, made once. On a table that already has records (an install
            # from before it) it starts past their largest token. The table lock keeps every
            # reservation out meanwhile (they take ROW EXCLUSIVE before calling nextval), so
            # no token is handed out between reading the largest and setting the sequence.
            f"DO $idempo$ BEGIN IF to_regclass('{self.sequence}') IS NULL THEN"
            f" LOCK TABLE {self.table} IN SHARE ROW EXCLUSIVE MODE;"
            f" CREATE SEQUENCE IF NOT EXISTS {self.sequence} AS bigint;"
            f" PERFORM setval('{self.sequence}', greatest(m, s.last_value))"
            f" FROM (SELECT max(token) AS m FROM {self.table}) AS r, {self.sequence} AS s"
            " WHERE m > 0;"
            " END IF; END $idempo$",
        ]

    @cached_property
    def reserve_sql(self) -> str:
        # One round trip for every case, and one index lookup for a replay: the insert and
        # the takeover only run when what the first read found calls for them (their guards
        # do not depend on the row, so PostgreSQL checks them once, before any scan). All
        # parts see the snapshot taken when the statement started, so a duplicate that
        # committed while we waited on its row is invisible here: then no row comes back and
        # the caller simply asks again. nextval runs only for a row being written.
        now = self.now
        takeover_allowed = (
            f"EXISTS (SELECT 1 FROM existing e WHERE e.expires_at <= {now}"
            f" OR (e.state = 'in_progress' AND e.lease_expires_at <= {now}"
            " AND e.fingerprint = :fingerprint)) AND "
        )
        insert = (
            f"INSERT INTO {self.table} AS r ({self.insert_columns})"
            f" SELECT {self.insert_values} WHERE NOT EXISTS (SELECT 1 FROM existing)"
            f" ON CONFLICT DO NOTHING RETURNING {_COLUMNS}"
        )
        return (
            f"WITH existing AS ({self.select_sql}),"
            f" inserted AS ({insert}),"
            f" taken AS ({self.takeover_where(takeover_allowed)})"
            f" SELECT true, {_COLUMNS}, {now} FROM inserted"
            f" UNION ALL SELECT true, {_COLUMNS}, {now} FROM taken"
            f" UNION ALL SELECT false, {_COLUMNS}, {now} FROM existing"
            " WHERE NOT EXISTS (SELECT 1 FROM inserted) AND NOT EXISTS (SELECT 1 FROM taken)"
        )

    def reserve(self, op: Reserve) -> SqlGen[Reservation]:
        params = self.reserve_params(op)
        for _ in range(_RESERVE_TRIES):
            rows = yield Statement(self.reserve_sql, params)
            reservation = self.judge_rows(rows, op)
            if reservation is not None:
                return reservation
        return InProgress(retry_after=min(op.lease.total_seconds(), 1.0))

    @cached_property
    def settle_sql(self) -> str:
        # A stale token must abort the transaction it runs in, even when COMMIT was pipelined
        # right behind it; SQL has no RAISE, so a failing cast carries the error.
        return (
            f"WITH settled AS ({self.settle_update} RETURNING token)"
            " SELECT CASE WHEN EXISTS (SELECT 1 FROM settled) THEN 1"
            # The same settle again (a retry whose answer was lost) succeeds unchanged.
            f" WHEN EXISTS ({self.settled_sql}) THEN 1"
            f" ELSE CAST(concat('{FENCED_MARKER}: stale token for key ', :key) AS integer) END"
        )

    def settle(self, op: Settle) -> SqlGen[None]:
        yield Statement(self.settle_sql, self.settle_params(op), fetch=False)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class SQLiteDialect(SqlDialect):
    """SQLite: the same steps as separate statements inside one write transaction.

    Times are integer microseconds since the epoch, so comparisons are exact. The token
    counter is a one-row table, read by the reservation and moved inside its transaction.
    """

    name = "sqlite"
    greatest = "max"
    purge_lock = ""  # one writer at a time: nothing to race with

    def db_time(self, value: datetime) -> Any:
        return (value - _EPOCH) // timedelta(microseconds=1)

    def py_time(self, value: Any) -> datetime:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"time {value!r} is not an integer")
        return _EPOCH + timedelta(microseconds=value)

    @property
    def next_token(self) -> str:
        return f"(SELECT value + 1 FROM {self.tokens})"

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
            f"CREATE TABLE IF NOT EXISTS {self.tokens} (value INTEGER NOT NULL)",
            # One row, made once; on an install from before it, past the largest token.
            f"INSERT INTO {self.tokens} (value) SELECT coalesce(max(token), 0)"
            f" FROM {self.table} WHERE NOT EXISTS (SELECT 1 FROM {self.tokens})",
        ]

    @cached_property
    def insert_sql(self) -> str:
        return (
            f"INSERT INTO {self.table} ({self.insert_columns}) VALUES ({self.insert_values})"
            f" ON CONFLICT DO NOTHING RETURNING {_COLUMNS}"
        )

    def reserve(self, op: Reserve) -> SqlGen[Reservation]:
        # Callers run this inside one write transaction, so the steps are atomic.
        op = self.fix_now(op)
        assert op.now is not None
        params = self.reserve_params(op)
        rows = yield Statement(self.insert_sql, params)
        if not rows:
            rows = yield Statement(self.takeover_sql, params)
        if rows:
            token = int(rows[0][5])
            yield Statement(
                f"UPDATE {self.tokens} SET value = :token WHERE value < :token",
                {"token": token},
                fetch=False,
            )
            return Acquired(token=token, recovery_point=rows[0][11])
        rows = yield Statement(self.select_sql, self.scope_params(op.scope))
        if not rows:
            return InProgress(retry_after=min(op.lease.total_seconds(), 1.0))
        record = self.record(rows[0], op.scope)
        return judge(record, op.fingerprint, op.now) or InProgress(retry_after=0.0)

    def settle(self, op: Settle) -> SqlGen[None]:
        op = self.fix_now(op)
        rows = yield Statement(f"{self.settle_update} RETURNING token", self.settle_params(op))
        if not rows:
            yield from self.settled_already(op)
