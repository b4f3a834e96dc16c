"""SQLite's statements: the steps of a reservation inside one write transaction, and the
single statements that stand for them on a fresh key (`alone_insert_sql`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from functools import cached_property, lru_cache
from typing import Any

from ..._core.ops import Renew, Reserve, Settle
from ..._core.record import Acquired, InProgress, Mismatch, Replay, Reservation, judge
from ...errors import CorruptRecordError
from .dialect import COLUMNS, ONE_US, Rows, SqlDialect, SqlGen, Statement, derived_name

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EVENTS = ("INSERT", "UPDATE OF token")


def _microseconds(span: timedelta) -> int:
    return span // ONE_US


class SQLiteDialect(SqlDialect):
    """SQLite: the same steps as separate statements inside one write transaction.

    Times are integer microseconds since the epoch, so comparisons are exact. The token
    counter is a one-row table, read by the reservation and moved inside its transaction
    (and by triggers, on a file migrated since they exist, with every token written); a
    fresh token is also at least the reservation's time in microseconds (see `next_token`).
    """

    name = "sqlite"
    greatest = "max"

    def __init__(self, table: str) -> None:
        super().__init__(table)
        schema, dot, bare = table.rpartition(".")
        # What `migrate` names the triggers that move the counter; a statement inside a
        # trigger may not name a schema, so the tables there go by their bare names.
        self.triggers = (derived_name(table, "token_made"), derived_name(table, "token_moved"))
        self._bare = (bare, self.tokens.rpartition(".")[2])
        self.master = f"{schema}{dot}sqlite_master"
        self.triggers_params = {"made": self.triggers[0].rpartition(".")[2]}
        self.triggers_params["moved"] = self.triggers[1].rpartition(".")[2]
        # Whether the file has those triggers (`SQLiteStore._has_triggers`); None: not
        # asked yet, or asked again since a `migrate`.
        self.has_triggers: bool | None = None

    def schema_changed(self) -> None:
        self.has_triggers = None

    def db_time(self, value: datetime) -> Any:
        return (value - _EPOCH) // ONE_US

    # `db_span`, remembered (as PostgreSQL's is): a policy passes the same few durations on
    # every call, and a builtin call costs less than the division's Python frame.
    db_span = staticmethod(lru_cache(maxsize=64)(_microseconds))

    def py_time(self, value: Any) -> datetime:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"time {value!r} is not an integer")
        return _EPOCH + timedelta(microseconds=value)

    @property
    def next_token(self) -> str:
        # The counter row is moved inside the reservation's transaction, so a reservation
        # that rolls back (transactional mode) moves it back too. The host's time in
        # microseconds (the statement's ``now``) keeps a later reservation's token past
        # every earlier one all the same, committed or not (SPEC §2 rule 8), as on Redis.
        return f"max((SELECT value + 1 FROM {self.tokens}), :now)"

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
            # (The aggregate goes in a subquery: an aggregate over no rows is still a row,
            # so a WHERE beside it added one more row on every migrate.)
            f"INSERT INTO {self.tokens} (value) SELECT"
            f" coalesce((SELECT max(token) FROM {self.table}), 0)"
            f" WHERE NOT EXISTS (SELECT 1 FROM {self.tokens})",
            # A file migrated more than once with that statement: the largest row stays.
            f"DELETE FROM {self.tokens} WHERE rowid <>"
            f" (SELECT rowid FROM {self.tokens} ORDER BY value DESC LIMIT 1)",
            *(
                self._trigger(name, event)
                for name, event in zip(self.triggers, _EVENTS, strict=True)
            ),
        ]

    def _trigger(self, name: str, event: str) -> str:
        # The counter follows every token written, in the writing statement itself: a
        # reservation that is one autocommit statement (`alone_insert_sql`) then needs no
        # transaction of its own to keep it, and one that rolls back takes its move along.
        # Integers only: SQLite orders any text after every number, so a hand-edited token
        # ('abc') would leave a counter that no integer passes and `value + 1` reads as 1.
        table, tokens = self._bare
        return (
            f"CREATE TRIGGER IF NOT EXISTS {name} AFTER {event} ON {table}"
            " WHEN typeof(NEW.token) = 'integer'"
            f" BEGIN UPDATE {tokens} SET value = NEW.token WHERE value < NEW.token; END"
        )

    @cached_property
    def triggers_sql(self) -> str:
        """How many of `triggers` the file has (2: `migrate` made them)."""
        return (
            f"SELECT count(*) FROM {self.master} WHERE type = 'trigger' AND name IN (:made, :moved)"
        )

    # The statements of a fresh call on the store's own connections bind their parameters by
    # position (``?N``): sqlite3 looks a named one up by a string it makes afresh each time.
    @cached_property
    def first_sql(self) -> str:
        """`select_sql`, on the parameters ``(principal, operation, key)``."""
        return (
            f"SELECT {COLUMNS} FROM {self.table}"
            " WHERE principal = ?1 AND operation = ?2 AND idem_key = ?3"
        )

    @cached_property
    def alone_insert_sql(self) -> str:
        """A fresh key's reservation as one statement, in autocommit, on the parameters
        of `alone_reserve_params`: the record is made with the reservation's time in
        microseconds as its token, only if that is past the counter (every token handed
        out); the counter follows by trigger. Otherwise (a record exists, or the clock is
        not past the counter) it changes nothing, and the reservation takes its
        transaction, whose token is ``max(counter + 1, now)``: the same token where both
        apply."""
        return (
            f"INSERT INTO {self.table} ({self.insert_columns})"
            " SELECT ?1, ?2, ?3, ?4, 'in_progress', ?5, ?5 + ?6, ?5, ?5, ?5 + ?7"
            f" WHERE ?5 > (SELECT max(value) FROM {self.tokens}) ON CONFLICT DO NOTHING"
        )

    def alone_reserve_params(self, op: Reserve, now: int) -> tuple[Any, ...]:
        """`alone_insert_sql`'s parameters, at ``now`` (a database time)."""
        scope, lease = op.scope, self.db_span(op.lease)
        return (scope.principal, scope.operation, scope.key, op.fingerprint, now, lease,
                lease + self.db_span(op.ttl))  # fmt: skip

    @cached_property
    def alone_settle_sql(self) -> str:
        """`settle_update` where it leaves ``expires_at`` as it is (the reservation's expiry
        already covers ``now + ttl``, as it does while the lease is held), on the
        parameters of `alone_settle_params`: a single UPDATE, so autocommit makes it
        atomic. Nothing changed: the reservation's transaction settles it (or says it is
        fenced)."""
        return (
            f"UPDATE {self.table} SET state = ?5, response = ?6, lease_expires_at = NULL,"
            " updated_at = ?7 WHERE principal = ?1 AND operation = ?2 AND idem_key = ?3"
            " AND token = ?4 AND state = 'in_progress' AND expires_at >= ?7 + ?8"
        )

    def alone_settle_params(self, op: Settle, now: int) -> tuple[Any, ...]:
        """`alone_settle_sql`'s parameters, at ``now`` (a database time)."""
        scope = op.scope
        return (scope.principal, scope.operation, scope.key, op.token, op.status.value,
                op.response, now, self.db_span(op.ttl))  # fmt: skip

    @cached_property
    def insert_sql(self) -> str:
        return (
            f"INSERT INTO {self.table} ({self.insert_columns}) VALUES ({self.insert_values})"
            f" ON CONFLICT DO NOTHING RETURNING {COLUMNS}"
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
            # A takeover keeps the record's creation time; a new record's is its update's.
            return Acquired(token, rows[0][11], taken_over=rows[0][8] != rows[0][9])
        rows = yield Statement(self.select_sql, self.scope_params(op.scope))
        if not rows:
            return InProgress(retry_after=min(op.lease.total_seconds(), 1.0))
        record = self.record(rows[0], op.scope)
        return judge(record, op.fingerprint, op.now) or InProgress(retry_after=0.0)

    def answered(self, rows: Rows, op: Reserve, now: datetime) -> Replay | Mismatch | None:
        """What the record in ``rows`` (`select_sql`'s, read at ``now``: ``op.now``, else
        the host's time, as `fix_now` fixes it) means for the reservation ``op``, if that
        takes no write: the replay of a settled record or a mismatch, as `judge` tells the
        reservation itself. None for the rest (no record, one in progress, expired, or one
        that cannot be read): the reservation decides those, atomically."""
        if not rows:
            return None
        try:
            verdict = judge(self.record(rows[0], op.scope), op.fingerprint, now)
        except CorruptRecordError:
            return None  # the reservation's own judging says what it means
        return verdict if isinstance(verdict, Replay | Mismatch) else None

    def lock(self, op: Renew) -> SqlGen[bool]:
        # The write lock is SQLite's only lock: the renewal's own write takes it.
        op = self.fix_now(op)
        rows = yield Statement(f"{self.renew_update} RETURNING token", self.renew_params(op))
        return bool(rows)

    def settle(self, op: Settle) -> SqlGen[None]:
        op = self.fix_now(op)
        rows = yield Statement(f"{self.settle_update} RETURNING token", self.settle_params(op))
        if not rows:
            yield from self.settled_already(op)
