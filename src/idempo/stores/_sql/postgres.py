"""PostgreSQL's statements: reservation, takeover and the fallback read in one statement."""

from __future__ import annotations

import copy
import operator
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any

from ..._core.ops import Reserve, Settle
from ..._core.record import InProgress, Reservation
from .dialect import COLUMNS, FENCED_MARKER, RESERVE_TRIES, SqlDialect, SqlGen, Statement

# What the statement after a reservation on the app's connection raises when the reservation
# holds nothing (a replay, a mismatch, a lost race), so that PostgreSQL ends the transaction
# the reservation ran in, with nothing else sent (see `PostgresDialect.unheld_sql`).
UNHELD_MARKER = "idempo-unheld"


def pg_ms(timeout: timedelta) -> str:
    """A lock timeout as PostgreSQL's setting (0 would mean no limit: 1 ms at least)."""
    return f"{max(1, int(timeout.total_seconds() * 1000))}ms"


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

    # The reservation's lock timeout (PostgreSQL's setting, "200ms") when the statement sets
    # it itself, on the app's connection; None on the store's own, where the session has it.
    lock_ms: str | None = None

    def __init__(self, table: str) -> None:
        super().__init__(table)
        self.sequence = self.tokens
        self._waiting: dict[str, PostgresDialect] = {}

    def waiting(self, lock_timeout: timedelta) -> PostgresDialect:
        """This dialect for the app's connection: its reservation waits on a row lock at most
        ``lock_timeout`` and sets that itself (made once per value, then reused)."""
        ms = pg_ms(lock_timeout)
        clone = self._waiting.get(ms)
        if clone is None:
            clone = copy.copy(self)
            clone.lock_ms = ms
            clone.__dict__.pop("reserve_statement", None)
            self._waiting[ms] = clone
        return clone

    def py_time(self, value: Any) -> datetime:
        # timestamptz comes back in the session's TimeZone; a record's times are UTC.
        result: datetime = value.astimezone(UTC)
        return result

    # Durations go as intervals, unchanged: a builtin (no Python frame on the hot path).
    db_span = staticmethod(operator.pos)  # type: ignore[assignment]

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
    def _takeover_allowed(self) -> str:
        now = self.now
        return (
            f"EXISTS (SELECT 1 FROM existing e WHERE e.expires_at <= {now}"
            f" OR (e.state = 'in_progress' AND e.lease_expires_at <= {now}"
            " AND e.fingerprint = :fingerprint)) AND "
        )

    @cached_property
    def _insert_sql(self) -> str:
        return (
            f"INSERT INTO {self.table} AS r ({self.insert_columns})"
            f" SELECT {self.insert_values} WHERE NOT EXISTS (SELECT 1 FROM existing)"
            f" ON CONFLICT DO NOTHING RETURNING {COLUMNS}"
        )

    @cached_property
    def reserve_sql(self) -> str:
        # One round trip for every case, and one index lookup for a replay: the insert and
        # the takeover only run when what the first read found calls for them (their guards
        # do not depend on the row, so PostgreSQL checks them once, before any scan). All
        # parts see the snapshot taken when the statement started, so a duplicate that
        # committed while we waited on its row is invisible here: then no row comes back and
        # the caller simply asks again. nextval runs only for a row being written.
        now = self.now
        return (
            f"WITH existing AS ({self.select_sql}),"
            f" inserted AS ({self._insert_sql}),"
            f" taken AS ({self.takeover_where(self._takeover_allowed)})"
            f" SELECT true, {COLUMNS}, {now} FROM inserted"
            f" UNION ALL SELECT true, {COLUMNS}, {now} FROM taken"
            f" UNION ALL SELECT false, {COLUMNS}, {now} FROM existing"
            " WHERE NOT EXISTS (SELECT 1 FROM inserted) AND NOT EXISTS (SELECT 1 FROM taken)"
        )

    @cached_property
    def locking_reserve_sql(self) -> str:
        """The reservation for the app's connection, carrying its own lock timeout.

        The app's statements must keep waiting as the app's connection says, so the
        statement sets ``lock_timeout`` for itself and puts the app's value back before it
        ends, with no statement of its own for either. The setting is made in ``saved``, which
        every part reads first (the read of ``existing`` is gated on it, and the insert and
        the takeover on ``existing``), so it is in force before any of them can wait on a row
        lock. It is put back in the projection of the one row the statement returns, made
        only once every part has run (a left join, so even a lost race, which finds nothing,
        returns a row, of NULLs). That row also leaves ``idempo.held`` = 'y' in the
        transaction when the key was taken: `unheld_sql` reads it.
        """
        now = self.now
        return (
            "WITH saved AS MATERIALIZED (SELECT set_config('idempo.lock_timeout',"
            " current_setting('lock_timeout'), true) AS app,"
            " set_config('lock_timeout', :lock_ms, true) AS ours),"
            f" existing AS ({self.select_sql} AND EXISTS (SELECT 1 FROM saved)),"
            f" inserted AS ({self._insert_sql}),"
            f" taken AS ({self.takeover_where(self._takeover_allowed)}),"
            f" answer AS (SELECT true AS acquired, {COLUMNS}, {now} AS decided FROM inserted"
            f" UNION ALL SELECT true, {COLUMNS}, {now} FROM taken"
            f" UNION ALL SELECT false, {COLUMNS}, {now} FROM existing"
            " WHERE NOT EXISTS (SELECT 1 FROM inserted) AND NOT EXISTS (SELECT 1 FROM taken))"
            " SELECT answer.*,"
            " set_config('lock_timeout', (SELECT app FROM saved), true),"
            " set_config('idempo.held', CASE WHEN answer.acquired THEN 'y' ELSE '' END, true)"
            " FROM (VALUES (1)) AS one (n) LEFT JOIN answer ON true"
        )

    # Sent right after the reservation when the guard begins the transaction (see
    # `_Batch` in stores/postgres.py): it fails unless the reservation took the key, and a
    # failure ends the transaction the reservation ran in before the BEGIN behind it.
    unheld_sql = (
        "SELECT CASE WHEN current_setting('idempo.held', true) = 'y' THEN 1 ELSE CAST("
        f"'{UNHELD_MARKER}: the reservation took no key, so the transaction it ran in ends"
        " here (this error is how idempo ends it without another round trip)' AS integer) END"
    )

    @cached_property
    def reserve_statement(self) -> str:
        return self.reserve_sql if self.lock_ms is None else self.locking_reserve_sql

    def reserve_params(self, op: Reserve) -> dict[str, Any]:
        params = super().reserve_params(op)
        if self.lock_ms is not None:
            # The caller's bound, when shorter than the unit's (a deadline), else the unit's.
            ms = self.lock_ms if op.lock_timeout is None else pg_ms(op.lock_timeout)
            params["lock_ms"] = ms
        return params

    def reserve(self, op: Reserve) -> SqlGen[Reservation]:
        params = self.reserve_params(op)
        sql = self.reserve_statement
        for _ in range(RESERVE_TRIES):
            rows = yield Statement(sql, params)
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
            # The token, not the key: the database's error text is the FencedError's cause,
            # and raw keys stay out of error messages.
            f" ELSE CAST(concat('{FENCED_MARKER}: token ', :token, ' is stale') AS integer) END"
        )

    def settle(self, op: Settle) -> SqlGen[None]:
        yield Statement(self.settle_sql, self.settle_params(op), fetch=False)
