"""The SQL every dialect shares, written once and run by any executor.

Each verb is a generator that yields `Statement`s and receives their rows, so the same text
runs on the store's own connections (leased mode), on the app's psycopg or sqlite3
connection, or through SQLAlchemy, sync or async. Executors only execute; they never decide.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Generator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any, NamedTuple, TypeVar, cast

from ..._core.digest import key_ref
from ..._core.keys import Scope, evict_hint
from ..._core.ops import Checkpoint, Release, Renew, Reserve, Settle
from ..._core.record import Acquired, Record, Reservation, Status, judge
from ...errors import ConfigurationError, CorruptRecordError, FencedError
from .. import _clock
from .._scan import ScanFilter

T = TypeVar("T")
Rows = list[tuple[Any, ...]]


class Statement(NamedTuple):
    """One SQL statement with ``:name`` parameters. ``fetch=False`` statements return nothing,
    so a pipelining executor may send them without waiting."""

    sql: str
    params: dict[str, Any]
    fetch: bool = True


SqlGen = Generator[Statement, Rows | None, T]

# A timedelta made once: making one (keyword arguments) costs more than the division by it.
ONE_US = timedelta(microseconds=1)
# Earlier than any record's expiry: where a sweep of purge batches starts.
_OLDEST = datetime(1, 1, 2, tzinfo=UTC)
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$")
_NAMED_PARAM = re.compile(r"(?<!:):([a-z_]+)")

# A takeover after a lost race is retried a few times before the caller is told to come back.
RESERVE_TRIES = 5
FENCED_MARKER = "idempo-fenced"


def pyformat(sql: str) -> str:
    """``:name`` placeholders as psycopg's ``%(name)s``."""
    return _NAMED_PARAM.sub(r"%(\1)s", sql.replace("%", "%%"))


COLUMNS = (
    "principal, operation, idem_key, fingerprint, state, token, lease_expires_at, response,"
    " created_at, updated_at, expires_at, recovery_point"
)
# What a listing reads: every column but the response, which a listing never carries.
LISTED_COLUMNS = COLUMNS.replace(" response,", " NULL AS response,")
_WHERE_SCOPE = "principal = :principal AND operation = :operation AND idem_key = :key"
# PostgreSQL keeps 63 bytes of a name and cuts the rest silently (MariaDB refuses past 64).
_MAX_NAME = 63

# A stored state's Status, by its text: a dict look-up costs a fraction of `Status(state)`,
# and a row is read on every call.
_STATUSES: dict[Any, Status] = {status.value: status for status in Status}

OpT = TypeVar("OpT", Reserve, Settle, Renew, Checkpoint)


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
        f"the stored record of {key_ref(scope.key)} (operation {scope.operation!r})"
        f" cannot be decoded ({why}); nothing was run or replayed."
        f" To evict it, {evict_hint(scope)} (or call store.evict(scope))"
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
    back (`next_token`: a sequence, or SQLite's counter row with the host's time as a floor,
    since a rolled-back reservation moves that row back), and a takeover's token is the
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
        # Where the sweep of purge batches has got to: the latest expiry the last full batch
        # took. The next batch starts its walk of the expires_at index there instead of
        # going again over the entries of the records just deleted (they stay in the index
        # until vacuum, or InnoDB's purge, removes them, which makes every batch of a long
        # purge slower than the one before). It only narrows what a batch may delete; what
        # it passes over (a record locked, or leased, at the time) the next sweep takes.
        self.purge_resume: datetime | None = None

    # -- what differs per database -------------------------------------------------------
    def db_time(self, value: datetime) -> Any:
        return value

    def db_span(self, value: timedelta) -> Any:
        """A duration as the statements' ``plus`` takes it: microseconds, by default."""
        return value // ONE_US

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

    def schema_changed(self) -> None:
        """Forget what was learnt of the schema (what a store found missing): `migrate` has
        just run, and may have made it."""

    def reserve(self, op: Reserve) -> SqlGen[Reservation]:
        raise NotImplementedError

    def settle(self, op: Settle) -> SqlGen[None]:
        raise NotImplementedError

    def fix_now(self, op: OpT) -> OpT:
        """``op`` as the statements take it: a store without a clock of its own decides on
        the host's (SPEC §2 rule 9); one with a clock reads it in the statement."""
        if op.now is not None or self.server_clock:
            return op
        now = _clock.host_now()
        # The two of every call made directly, not by dataclasses.replace (which costs
        # more than the rest of this step).
        if type(op) is Reserve:
            fixed: Any = Reserve(op.scope, op.fingerprint, now, op.lease, op.ttl, op.lock_timeout)
        elif type(op) is Settle:
            fixed = Settle(op.scope, op.token, op.status, op.response, now, op.ttl)
        else:
            fixed = replace(op, now=now)
        return cast(OpT, fixed)

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
            f" WHERE {condition}{_WHERE_SCOPE} AND {self.takeable('r')}"
            f" RETURNING {COLUMNS}"
        )

    def takeable(self, alias: str) -> str:
        """SQL that is true when the record ``alias`` may be taken over at ``now`` by the
        reservation's request: its retention is over, or its lease is and the request is the
        same (``:fingerprint``). NULL, not false, for an in-progress record without a lease,
        which only a corrupt row is: every use takes only true for a takeover."""
        now = self.now
        return (
            f"({alias}.expires_at <= {now} OR ({alias}.state = 'in_progress'"
            f" AND {alias}.lease_expires_at <= {now} AND {alias}.fingerprint = :fingerprint))"
        )

    @cached_property
    def select_sql(self) -> str:
        return f"SELECT {COLUMNS} FROM {self.table} WHERE {self.where_scope}"

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
            raise FencedError(f"cannot settle {key_ref(op.scope.key)}: token {op.token} is stale")

    def _extend_update(self, sets: str) -> str:
        """The fenced UPDATE that moves the lease to ``now + lease``, setting ``sets`` too."""
        until = self.plus(self.now, "lease")
        return (
            f"UPDATE {self.table} SET {sets}lease_expires_at = {until}, updated_at = {self.now},"
            f" expires_at = CASE WHEN expires_at < {until} THEN {until} ELSE expires_at END"
            f" WHERE {self.where_scope} AND token = :token AND state = 'in_progress'"
        )

    @cached_property
    def renew_update(self) -> str:
        return self._extend_update("")

    @cached_property
    def checkpoint_update(self) -> str:
        return self._extend_update("recovery_point = COALESCE(:point, recovery_point), ")

    def renew_params(self, op: Renew | Checkpoint) -> dict[str, Any]:
        return {
            **self.scope_params(op.scope),
            "token": op.token,
            "now": self.time_value(op.now),
            "lease": self.db_span(op.lease),
        }

    def checkpoint_params(self, op: Checkpoint) -> dict[str, Any]:
        return {**self.renew_params(op), "point": op.point}

    @cached_property
    def expired(self) -> str:
        """Which records purge may delete: retention over, and no live lease."""
        before = self.time_param("before")
        return (
            f"expires_at <= {before} AND (state <> 'in_progress' OR lease_expires_at <= {before})"
        )

    @cached_property
    def purgeable(self) -> str:
        """`expired`, among the records the current sweep of purge batches has not passed."""
        return f"{self.expired} AND expires_at >= {self.cast_time('resume')}"

    def purge_params(self, before: datetime | None, limit: int) -> dict[str, Any]:
        if before is None and not self.server_clock:
            before = _clock.host_now()
        resume = self.db_time(self.purge_resume or _OLDEST)
        return {"before": self.time_value(before), "limit": int(limit), "resume": resume}

    def record(self, row: tuple[Any, ...], asked: Scope | None = None) -> Record:
        """The record a row holds; `CorruptRecordError` if it holds something no store
        writes (another program's row, a hand edit), named by ``asked`` or its own scope."""
        (principal, operation, key, fp, state, token, lease, response, created, updated,
         expires, point) = row  # fmt: skip
        if (
            asked is not None
            and asked.key == key
            and asked.operation == operation
            and asked.principal == principal
        ):
            scope = asked  # the row of the scope asked for, as nearly every read is
        else:
            scope = Scope(principal, operation, key)
        try:
            if not isinstance(fp, str) or not (point is None or isinstance(point, str)):
                raise TypeError("the fingerprint or recovery point is not text")
            if isinstance(token, bool) or not isinstance(token, int) or token < 1:
                raise ValueError(f"token {token!r}")
            status = _STATUSES.get(state)
            if status is None:
                raise ValueError(f"{state!r} is not a valid Status")
            if lease is None and status is Status.IN_PROGRESS:
                # Nothing could take it over (no lease to end) and no holder will settle it.
                raise ValueError("an in-progress record without a lease")
            py_time = self.py_time
            return Record(
                scope,
                fp,
                status,
                token,
                None if lease is None else py_time(lease),
                None if response is None else bytes(response),
                py_time(created),
                py_time(updated),
                py_time(expires),
                point,
            )
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            raise corrupt(asked or scope, f"{type(exc).__name__}: {exc}") from exc

    # A release never forgets committed steps: a record with a recovery point keeps it, and
    # its lease ends on its own (the flow ends it at once, with a checkpoint).
    release_where = " AND token = :token AND state = 'in_progress' AND recovery_point IS NULL"

    def release(self, op: Release) -> SqlGen[None]:
        yield Statement(
            f"DELETE FROM {self.table} WHERE {self.where_scope}{self.release_where}",
            {**self.scope_params(op.scope), "token": op.token},
            fetch=False,
        )

    def renew(self, op: Renew) -> SqlGen[None]:
        op = self.fix_now(op)
        yield from self._extended(op, self.renew_update, self.renew_params(op), "renew")

    def checkpoint(self, op: Checkpoint) -> SqlGen[None]:
        op = self.fix_now(op)
        params = self.checkpoint_params(op)
        yield from self._extended(op, self.checkpoint_update, params, "record a step of")

    def _extended(
        self, op: Renew | Checkpoint, update: str, params: dict[str, Any], verb: str
    ) -> SqlGen[None]:
        """Run a lease-extending UPDATE; no row returned means the token was stale."""
        rows = yield Statement(f"{update} RETURNING token", params)
        if not rows:
            raise FencedError(f"cannot {verb} {key_ref(op.scope.key)}: token {op.token} is stale")

    @cached_property
    def lock_sql(self) -> str:
        return (
            f"SELECT token FROM {self.table} WHERE {self.where_scope}"
            " AND token = :token AND state = 'in_progress' FOR UPDATE"
        )

    def lock(self, op: Renew) -> SqlGen[bool]:
        """Take the record's row lock in the transaction this runs in, fenced on the token:
        True if the record is still this holder's (leased mode on the app's connection)."""
        params = {**self.scope_params(op.scope), "token": op.token}
        return bool((yield Statement(self.lock_sql, params)))

    def get(self, scope: Scope) -> SqlGen[Record | None]:
        rows = yield Statement(self.select_sql, self.scope_params(scope))
        return self.record(rows[0], scope) if rows else None

    def purge(self, before: datetime | None, limit: int) -> SqlGen[int]:
        """Delete up to ``limit`` expired records, one batch (two at the end of a sweep)."""
        resumed = self.purge_resume is not None
        count, latest = yield from self.purge_batch(self.purge_params(before, limit))
        if count < limit and resumed:
            # The sweep is over. What expired behind it (a shorter retention, a record that
            # was locked or leased as the sweep passed) is looked for from the oldest at once,
            # so that batches until a short one still leave nothing purgeable behind.
            self.purge_resume = None
            more, latest = yield from self.purge_batch(self.purge_params(before, limit - count))
            count += more
        self.purge_resume = None if count < limit or latest is None else self.py_time(latest)
        return count

    def purge_batch(self, params: dict[str, Any]) -> SqlGen[tuple[int, Any]]:
        """One bounded delete: how many records it took, and the latest expiry among them
        (a database value; None for none)."""
        # The outer WHERE states the conditions again, for a store whose subquery and delete
        # could see different row versions; SQLite, the store this serves, has one writer at
        # a time, so nothing races it there.
        rows = yield Statement(
            f"DELETE FROM {self.table} WHERE (principal, operation, idem_key) IN ("
            f" SELECT principal, operation, idem_key FROM {self.table}"
            f" WHERE {self.purgeable} ORDER BY expires_at LIMIT :limit) AND {self.expired}"
            " RETURNING expires_at",
            params,
        )
        expiries = [row[0] for row in rows or ()]
        return len(expiries), max(expiries, default=None)

    def evict(self, scope: Scope) -> SqlGen[bool]:
        rows = yield Statement(
            f"DELETE FROM {self.table} WHERE {self.where_scope} RETURNING 1",
            self.scope_params(scope),
        )
        return bool(rows)

    def scan(self, where: ScanFilter) -> SqlGen[list[Record]]:
        """Up to ``where.limit`` records that pass ``where``, oldest first, without their
        responses (the optional ``scan`` verb; never on a hot path). Unindexed filters
        make it a scan of the table, as `stats` is; the limit bounds what comes back."""
        clauses: list[str] = []
        params: dict[str, Any] = {"limit": where.limit}
        if where.status is not None:
            clauses.append("state = :state")
            params["state"] = where.status.value
        if where.operation is not None:
            clauses.append("operation = :operation")
            params["operation"] = where.operation
        if where.principal is not None:
            clauses.append("principal = :principal")
            params["principal"] = where.principal
        if where.created_before is not None:
            clauses.append(f"created_at <= {self.cast_time('created_before')}")
            params["created_before"] = self.db_time(where.created_before)
        condition = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = yield Statement(
            f"SELECT {LISTED_COLUMNS} FROM {self.table}{condition}"
            " ORDER BY created_at, idem_key LIMIT :limit",
            params,
        )
        return [self.record(row) for row in rows or ()]

    def stats(self) -> SqlGen[dict[str, int]]:
        rows = yield Statement(f"SELECT state, count(*) FROM {self.table} GROUP BY state", {})
        return {str(state): int(count) for state, count in rows or ()}

    def judge_rows(self, rows: Rows | None, op: Reserve) -> Reservation | None:
        """Decode a reservation statement's row ``(acquired, *columns, decided_at, ...)``:
        acquired, or what the record means at the instant the statement decided. None when
        it found nothing (no row, or a row whose ``acquired`` is NULL: a lost race)."""
        if not rows:
            return None
        row = rows[0]
        acquired = row[0]
        if acquired:
            # A takeover keeps the record's creation time; a new record's is its update's.
            return Acquired(token=int(row[6]), recovery_point=row[12], taken_over=row[9] != row[10])
        if acquired is None:
            return None
        return judge(self.record(row[1:13], op.scope), op.fingerprint, self.py_time(row[13]))
