"""PostgreSQL's statements: reservation, takeover and the fallback read in one statement."""

from __future__ import annotations

import copy
import operator
import re
import zlib
from datetime import UTC, timedelta
from functools import cached_property, lru_cache
from time import monotonic
from typing import Any

from ..._core.digest import key_ref
from ..._core.keys import Scope
from ..._core.ops import Checkpoint, Release, Reserve, Settle
from ..._core.record import InProgress, Reservation
from ...errors import FencedError, SchemaMissingError
from .dialect import (
    COLUMNS,
    FENCED_MARKER,
    RESERVE_TRIES,
    SqlDialect,
    SqlGen,
    Statement,
    derived_name,
)

# What the statement after a reservation on the app's connection raises when the reservation
# holds nothing (a replay, a mismatch, a lost race), so that PostgreSQL ends the transaction
# the reservation ran in with nothing more sent (see `PostgresDialect.UNHELD_SQL`).
UNHELD_MARKER = "idempo-unheld"


# The first half of the two-int advisory lock key of a waiting duplicate's mark ("idem"): the
# two-int form never meets an app's bigint advisory locks, and this class its other ones.
WAKE_CLASS = int.from_bytes(b"idem")
# What the settle and release statements run for the record's waiters: the mark is free (no
# one waits) when this statement's transaction can take it exclusively, and then holds it to
# its commit, so that a waiter arriving meanwhile waits for the commit on its shared lock and
# reads the settled record; otherwise a notification, sent at the commit. Never a NOTIFY when
# no one waits: each one takes a database-wide lock at the commit (docs/decisions.md).
_WAKE = (
    f"CASE WHEN NOT pg_try_advisory_xact_lock({WAKE_CLASS}, CAST(:wake AS integer))"
    " THEN pg_notify('idempo_wake_' || CAST(:wake AS integer), '') END"
)


# The reservation function's parameters (`PostgresDialect.function_ddl`), in order: the
# reservation statement's own parameter names, then the lock timeout its writes wait under on
# the app's connection (NULL on the store's own, whose session has it), and their types.
_FUNCTION_PARAMS = (
    "principal", "operation", "key", "fingerprint", "now", "lease", "lease_ttl", "lock_ms",
)  # fmt: skip
_FUNCTION_TYPES = "text, text, text, text, timestamptz, interval, interval, text"
# What it returns: the reservation statement's row, ``(acquired, *COLUMNS, decided)``.
_ROW_TYPES = (
    "boolean", "text", "text", "text", "text", "text", "bigint", "timestamptz", "bytea",
    "timestamptz", "timestamptz", "timestamptz", "text", "timestamptz",
)  # fmt: skip
_ROW_NAMES = ("acquired", *(name.strip() for name in COLUMNS.split(",")), "decided")
# The advisory lock `migrate` takes around making the function ("idmi", and the function's
# hash): two migrations at once (migrate on open, in each of an app's workers) would
# otherwise fail one of them ("tuple concurrently updated").
MIGRATE_CLASS = int.from_bytes(b"idmi")
_PARAM = re.compile(r"(?<!:):([a-z_]+)")


def positional(sql: str) -> str:
    """A reservation statement's ``:name`` parameters as the function's ``$n``."""
    return _PARAM.sub(lambda found: f"${_FUNCTION_PARAMS.index(found[1]) + 1}", sql)


class Installed:
    """Whether the table's reservation function exists (None: not known yet), learnt by the
    first reservation and shared by a dialect and its clones (`PostgresDialect.waiting`)."""

    __slots__ = ("present",)

    def __init__(self) -> None:
        self.present: bool | None = None


def pg_interval(span: timedelta) -> str:
    """A duration as PostgreSQL's interval input reads it, days as days, as psycopg sends a
    timedelta (a day added in a time zone with daylight saving is a calendar day)."""
    return f"{span.days} days {span.seconds}.{span.microseconds:06d} seconds"


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

    # The reservation's lock timeout (PostgreSQL's setting, "200ms") when its statement sets
    # it itself, on the app's connection; None on the store's own, where the session has it.
    lock_ms: str | None = None

    def __init__(self, table: str) -> None:
        super().__init__(table)
        self.sequence = self.tokens
        # The reservation function `migrate` installs, named from the table as its sequence
        # is (a function is no relation: it never meets a table of that name).
        self.function = derived_name(table, "reserve")
        self.signature = f"{self.function}({_FUNCTION_TYPES})"
        # The earlier version's function (no lock timeout), which `migrate` leaves for that
        # version's processes: `idempo doctor` names it when it is all there is.
        self.earlier_signature = f"{self.function}({_FUNCTION_TYPES.rsplit(', ', 1)[0]})"
        self.installed = Installed()
        self._waiting: dict[str, PostgresDialect] = {}

    def schema_changed(self) -> None:
        self.installed.present = None  # asked again: `migrate` may just have made it

    def waiting(self, lock_timeout: timedelta) -> PostgresDialect:
        """This dialect for the app's connection: its reservation waits on a row lock at most
        ``lock_timeout``, set by the statement itself (made once per value, then reused)."""
        ms = pg_ms(lock_timeout)
        clone = self._waiting.get(ms)
        if clone is None:
            clone = copy.copy(self)
            clone.lock_ms = ms
            self._waiting[ms] = clone
        return clone

    # timestamptz comes back in the session's TimeZone; a record's times are UTC. A builtin,
    # as db_span: a record's decode converts four times, and a Python frame each costs more.
    py_time = operator.methodcaller("astimezone", UTC)  # type: ignore[assignment]

    # Durations go as interval text, made once per value (few distinct ones are used): the
    # statements cast them (``CAST(:lease AS interval)``), so any driver sends them as the
    # plain text they are, where a timedelta costs a driver a dumper of its own per call.
    db_span = staticmethod(lru_cache(maxsize=128)(pg_interval))

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
        """One statement, every step of it under `_locked`'s advisory lock: stores migrating
        at once (migrate on open, in each of an app's workers) take turns, where two
        ``CREATE TABLE IF NOT EXISTS`` of one new table both pass the check and one then
        fails on the catalog's unique index (it did, in every round of six at once). One
        transaction too, so a migration that fails leaves nothing half made."""
        index = self.table.replace(".", "_") + "_expires_at"
        return [
            self._locked(
                f"CREATE TABLE IF NOT EXISTS {self.table} ("
                " principal text NOT NULL, operation text NOT NULL, idem_key text NOT NULL,"
                " fingerprint text NOT NULL, state text NOT NULL, token bigint NOT NULL,"
                " lease_expires_at timestamptz, response bytea,"
                " created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL,"
                " expires_at timestamptz NOT NULL, recovery_point text,"
                " PRIMARY KEY (principal, operation, idem_key))"
                # Room on each page for the one in-place update a record gets when it
                # completes.
                " WITH (fillfactor = 80);"
                f" CREATE INDEX IF NOT EXISTS {index.rsplit('.', 1)[-1]}"
                f" ON {self.table} (expires_at);"
                # The token sequence, made once. On a table that already has records (an
                # install from before it) it starts past their largest token. The table lock
                # keeps every reservation out meanwhile (they take ROW EXCLUSIVE before
                # calling nextval), so no token is handed out between reading the largest
                # and setting the sequence.
                f" IF to_regclass('{self.sequence}') IS NULL THEN"
                f" LOCK TABLE {self.table} IN SHARE ROW EXCLUSIVE MODE;"
                f" CREATE SEQUENCE IF NOT EXISTS {self.sequence} AS bigint;"
                f" PERFORM setval('{self.sequence}', greatest(m, s.last_value))"
                f" FROM (SELECT max(token) AS m FROM {self.table}) AS r, {self.sequence} AS s"
                " WHERE m > 0;"
                " END IF; "
                f"{self._function_step}"
            )
        ]

    def _locked(self, steps: str) -> str:
        """``steps`` (PL/pgSQL) as one statement that first waits for the table's migration
        lock: an advisory lock ("idmi" and a hash of the function's name) held until the
        statement's transaction ends."""
        lock = f"{MIGRATE_CLASS}, {zlib.crc32(self.function.encode()) >> 1}"
        return f"DO $migrate$ BEGIN PERFORM pg_advisory_xact_lock({lock}); {steps} END $migrate$"

    @cached_property
    def function_body(self) -> str:
        """The reservation function's PL/pgSQL: the reservation statement's answer, with no
        write where it needs none.

        It reads the record first. A record found that no takeover may take (`takeable` not
        true: completed or failed within its retention, a live lease, another request's
        fingerprint) is answered as it is, as the reservation statement answers it, without
        setting up the insert and the update that statement plans even when their guards
        skip them. No record found: the insert, alone; a record that may be taken over, or
        an insert that met one (a duplicate's, committed since the read or in flight): the
        reservation statement itself, whose fresh snapshot decides as a retry would.
        docs/decisions.md ("PostgreSQL's reservation function") has why each answer is one
        the reservation statement could have given.

        On the app's connection (``lock_ms`` given) only the writes can wait on another
        transaction's row lock, so the function sets its lock timeout before them and puts
        the app's back after them: an answer from the read alone touches no setting. A
        write that fails with the timeout fails the transaction, whose rollback (to a
        savepoint too) undoes the local setting. It also leaves ``idempo.held`` = 'y' in the
        transaction when it took the key, '' otherwise, for `UNHELD_SQL`.
        """
        now, row = self.now, ", ".join(f"r.{name}" for name in _ROW_NAMES[1:-1])
        into = ", ".join(_ROW_NAMES)
        read = (
            f"SELECT false, {row}, {now}, {self.takeable('r')} IS TRUE"
            f" INTO {into}, stale FROM {self.table} AS r WHERE {self.where_record}"
        )
        insert = (
            f"INSERT INTO {self.table} AS r ({self.insert_columns}) VALUES ({self.insert_values})"
            f" ON CONFLICT DO NOTHING RETURNING true, {row}, {now} INTO {into}"
        )
        on_app = "  IF :lock_ms IS NOT NULL THEN"
        # The OUT parameters are named as the table's columns: the columns win (the
        # function's own values are only ever assigned, by INTO). Assignments leave FOUND
        # alone; ``stale`` is NULL only when the read found no record.
        return positional(
            "#variable_conflict use_column\n"
            "DECLARE stale boolean; app text; setting text;\n"
            "BEGIN\n"
            f"  {read};\n"
            "  IF FOUND AND NOT stale THEN\n"
            f"  {on_app} setting := set_config('idempo.held', '', true); END IF;\n"
            "    RETURN;\n"
            "  END IF;\n"
            f"{on_app} app := current_setting('lock_timeout');"
            " setting := set_config('lock_timeout', :lock_ms, true); END IF;\n"
            "  IF stale IS NULL THEN\n"
            f"    {insert};\n"
            "  END IF;\n"
            "  IF acquired IS NOT TRUE THEN\n"
            f"    {self.reserve_sql} INTO {into};\n"
            "  END IF;\n"
            f"{on_app} setting := set_config('lock_timeout', app, true);"
            " setting := set_config('idempo.held', CASE WHEN acquired THEN 'y' ELSE '' END, true);"
            " END IF;\n"
            "END"
        )

    @cached_property
    def _function_step(self) -> str:
        outs = ", ".join(f"OUT {n} {t}" for n, t in zip(_ROW_NAMES, _ROW_TYPES, strict=True))
        return (
            f"CREATE OR REPLACE FUNCTION {self.function}({_FUNCTION_TYPES}, {outs})"
            f" LANGUAGE plpgsql VOLATILE AS $idempo$\n{self.function_body}\n$idempo$;"
        )

    @cached_property
    def function_ddl(self) -> str:
        """The reservation function made (or remade) alone, under the migration lock: the
        last step of `ddl`."""
        return self._locked(self._function_step)

    @property
    def where_record(self) -> str:
        """`where_scope` on the record aliased ``r``."""
        return "r.principal = :principal AND r.operation = :operation AND r.idem_key = :key"

    @cached_property
    def _takeover_allowed(self) -> str:
        return f"EXISTS (SELECT 1 FROM existing e WHERE {self.takeable('e')}) AND "

    @cached_property
    def _writes(self) -> str:
        # One round trip for every case, and one index lookup for a replay: the insert and
        # the takeover only run when what the first read found calls for them (their guards
        # do not depend on the row, so PostgreSQL checks them once, before any scan). All
        # parts see the snapshot taken when the statement started, so a duplicate that
        # committed while we waited on its row is invisible here: then no row comes back and
        # the caller simply asks again. nextval runs only for a row being written.
        insert = (
            f"INSERT INTO {self.table} AS r ({self.insert_columns})"
            f" SELECT {self.insert_values} WHERE NOT EXISTS (SELECT 1 FROM existing)"
            f" ON CONFLICT DO NOTHING RETURNING {COLUMNS}"
        )
        return f"inserted AS ({insert}), taken AS ({self.takeover_where(self._takeover_allowed)})"

    def _answer(self, extra: str = "") -> str:
        """The reservation's row ``(acquired, *columns, decided_at)``: the record written,
        else the one found; ``extra``: more columns of each, after those."""
        now = self.now
        return (
            f"SELECT true AS acquired, {COLUMNS}, {now} AS decided{extra} FROM inserted"
            f" UNION ALL SELECT true, {COLUMNS}, {now}{extra} FROM taken"
            f" UNION ALL SELECT false, {COLUMNS}, {now}{extra} FROM existing"
            " WHERE NOT EXISTS (SELECT 1 FROM inserted) AND NOT EXISTS (SELECT 1 FROM taken)"
        )

    @cached_property
    def reserve_sql(self) -> str:
        """The reservation statement on the store's own connection, whose session has its
        lock timeout: the reservation function's last resort, and the reservation itself
        where the function is missing (a table migrated before it)."""
        return f"WITH existing AS ({self.select_sql}), {self._writes} {self._answer()}"

    @cached_property
    def _probe(self) -> str:
        """A last column for the reservation statement: whether the function exists."""
        return f", to_regprocedure('{self.signature}') IS NOT NULL"

    @cached_property
    def probing_reserve_sql(self) -> str:
        """`reserve_sql` that also says whether the function exists, for the first
        reservation (no round trip of its own; a row missing, from a lost race, asks again)."""
        return f"WITH existing AS ({self.select_sql}), {self._writes} {self._answer(self._probe)}"

    @cached_property
    def call_sql(self) -> str:
        """The reservation through the function: one row, all NULL when it found nothing
        (a lost race, as the statement's no row). On the app's connection the function sets
        the lock timeout itself, around its writes (`function_body`)."""
        args = (
            ":principal, :operation, :key, :fingerprint, CAST(:now AS timestamptz),"
            " CAST(:lease AS interval), CAST(:lease_ttl AS interval), CAST(:lock_ms AS text)"
        )
        return f"SELECT * FROM {self.function}({args})"

    def reserve_statement(self, present: bool | None) -> str:
        """The reservation's SQL where the function exists (``present``), does not, or may."""
        if present:
            return self.call_sql
        if self.lock_ms is None:
            return self.reserve_sql if present is False else self.probing_reserve_sql
        return self.waiting_reserve_sql if present is False else self.probing_waiting_sql

    @cached_property
    def waiting_reserve_sql(self) -> str:
        """The reservation on the app's connection, carrying its own lock timeout.

        The app's statements must keep waiting as the app's connection says, so the
        statement sets ``lock_timeout`` for itself (``:lock_ms``) and puts the app's back
        before it ends, with no statement of its own for either. ``saved`` reads the app's
        value, then sets ours (the subquery is a plan node of its own, so it runs first);
        every part reads it first (the read of ``existing`` is gated on it, the insert and
        the takeover on ``existing``), so ours is in force before any of them can wait on a
        row lock. The app's comes back in the projection of the statement's one row, made
        once every part has run; a left join makes that row even when the parts found
        nothing (a lost race): then it is all NULLs but the restored setting. A statement
        that fails leaves ours in force only in a transaction that failed with it: its
        rollback (to a savepoint too) undoes a local setting. The row also leaves
        ``idempo.held`` = 'y' in the transaction when it took the key, for `UNHELD_SQL`.
        """
        return self._waiting_around(self._waiting_parts)

    @cached_property
    def _waiting_parts(self) -> str:
        return (
            f"existing AS ({self.select_sql} AND EXISTS (SELECT 1 FROM saved)),"
            f" {self._writes}, answer AS ({self._answer()})"
        )

    @cached_property
    def probing_waiting_sql(self) -> str:
        """`waiting_reserve_sql` that also says whether the function exists (its one row
        always comes back)."""
        return self._waiting_around(self._waiting_parts, self._probe)

    def _waiting_around(self, answer: str, extra: str = "") -> str:
        """The reservation ``answer`` (CTEs ending in one named ``answer``) with the lock
        timeout set before it and put back after it, and ``idempo.held`` left behind;
        ``extra``: more columns, last."""
        saved = (
            "SELECT app, set_config('lock_timeout', :lock_ms, true) FROM"
            " (SELECT current_setting('lock_timeout') AS app OFFSET 0) AS s"
        )
        return (
            f"WITH saved AS MATERIALIZED ({saved}), {answer}"
            " SELECT answer.*, set_config('lock_timeout', (SELECT app FROM saved), true),"
            " set_config('idempo.held', CASE WHEN answer.acquired THEN 'y' ELSE '' END, true)"
            f"{extra} FROM (VALUES (1)) AS one (n) LEFT JOIN answer ON true"
        )

    # Sent right after a reservation that runs before BEGIN (see `_Batch` in
    # stores/postgres.py): it fails unless the reservation took the key, and its failure
    # ends the transaction the reservation ran in, with BEGIN and all behind it unrun. The
    # cast is of a function's result, not of a literal, so that neither the parser nor the
    # planner folds it (and fails) when the key is held.
    UNHELD_SQL = (
        "SELECT CASE WHEN current_setting('idempo.held', true) = 'y' THEN 1 ELSE"
        f" CAST(concat('{UNHELD_MARKER}: the reservation took no key, so the transaction it ran"
        " in ends here (this error is how idempo ends it without another round trip)')"
        " AS integer) END"
    )

    def reserve(self, op: Reserve) -> SqlGen[Reservation]:
        params = self.reserve_params(op)
        params["lock_ms"] = self.lock_ms
        installed = self.installed
        present = installed.present
        sql = self.reserve_statement(present)
        for _ in range(RESERVE_TRIES):
            try:
                rows = yield Statement(sql, params)
            except SchemaMissingError:
                # The function (or the table) went since it was found: ask again next time.
                installed.present = None
                raise
            if present is None and rows:
                # The probe's answer, the row's last column: from now on, the one or the
                # other, for every reservation of this store (`migrate` asks again).
                present = installed.present = bool(rows[0][-1])
                sql = self.reserve_statement(present)
            reservation = self.judge_rows(rows, op)
            if reservation is not None:
                return reservation
        return InProgress(retry_after=min(op.lease.total_seconds(), 1.0))

    @cached_property
    def settle_sql(self) -> str:
        # A stale token must abort the transaction it runs in, even when COMMIT was pipelined
        # right behind it; SQL has no RAISE, so a failing cast carries the error.
        # The record's waiters are told (`_WAKE`) only when this settles it.
        return (
            f"WITH settled AS ({self.settle_update} RETURNING {_WAKE})"
            " SELECT CASE WHEN EXISTS (SELECT 1 FROM settled) THEN 1"
            # The same settle again (a retry whose answer was lost) succeeds unchanged.
            f" WHEN EXISTS ({self.settled_sql}) THEN 1"
            # The token, not the key: the database's error text is the FencedError's cause,
            # and raw keys stay out of error messages.
            f" ELSE CAST(concat('{FENCED_MARKER}: token ', :token, ' is stale') AS integer) END"
        )

    def settle(self, op: Settle) -> SqlGen[None]:
        params = self.settle_params(op)
        params["wake"] = self.wake_key(op.scope)
        yield Statement(self.settle_sql, params, fetch=False)

    @cached_property
    def release_sql(self) -> str:
        return (
            f"WITH gone AS (DELETE FROM {self.table} WHERE {self.where_scope}{self.release_where}"
            f" RETURNING {_WAKE}) SELECT count(*) FROM gone"
        )

    def release(self, op: Release) -> SqlGen[None]:
        params = {**self.scope_params(op.scope), "token": op.token}
        params["wake"] = self.wake_key(op.scope)
        yield Statement(self.release_sql, params, fetch=False)

    @cached_property
    def lease_end_sql(self) -> str:
        return f"{self.checkpoint_update} RETURNING {_WAKE}"

    def checkpoint(self, op: Checkpoint) -> SqlGen[None]:
        if op.lease > timedelta(0):
            yield from super().checkpoint(op)
            return
        # A lease ended by its holder (the flow's release of an attempt whose steps
        # committed): a waiter may take over at once, so it is told as for a release.
        op = self.fix_now(op)
        params = {**self.checkpoint_params(op), "wake": self.wake_key(op.scope)}
        if not (yield Statement(self.lease_end_sql, params)):
            stale = f"token {op.token} is stale"
            raise FencedError(f"cannot record a step of {key_ref(op.scope.key)}: {stale}")

    def wake_key(self, scope: Scope) -> int:
        """The second half of the advisory lock key that marks a waiter of ``scope``'s
        record, and its channel's number: a hash of the table and the scope (NUL is in no
        PostgreSQL text), 31 bits so that it is a positive integer. Two scopes that share
        one only wake each other's waiters for nothing."""
        parts = (self.table, scope.principal, scope.operation, scope.key)
        return zlib.crc32("\0".join(parts).encode()) >> 1

    def watch(self, scope: Scope, seconds: float) -> Watch:
        """What a duplicate runs to wait for the record of ``scope`` to settle, at most
        ``seconds`` from now (the store's ``wait_settled``)."""
        return Watch(self, scope, monotonic() + seconds)

    @cached_property
    def purge_sql(self) -> str:
        # The subquery walks the expires_at index oldest first, from where the sweep is, and
        # locks what it picks, skipping rows a takeover holds (they are being made live).
        # The delete then finds the picked row versions by their physical address, a TID
        # scan, so neither plan (custom, or the generic one a prepared statement ends up
        # with) can turn the batch into a scan or a join. A picked row stays locked until
        # the statement ends, so nothing rewrites it in between; the outer WHERE states the
        # conditions again all the same, because READ COMMITTED re-checks only that clause on
        # a row version written after the statement's snapshot (issue 10, #1).
        # One row comes back, the count and the latest expiry, not a row per record.
        # The batch commits without waiting for its WAL to reach the disk (or a synchronous
        # standby): a crash can lose only the last few ms of deletions, of records that are
        # still expired and that the next purge deletes again; a later commit that waits
        # flushes the WAL up to itself, this delete included (docs/decisions.md). The
        # setting is local (``true``) to the statement's own transaction, the pooled
        # connection's autocommit one, so it ends with it.
        return (
            f"WITH gone AS (DELETE FROM {self.table} WHERE ctid = ANY(ARRAY("
            f"SELECT ctid FROM {self.table} WHERE {self.purgeable}"
            " ORDER BY expires_at LIMIT :limit FOR UPDATE SKIP LOCKED))"
            f" AND {self.expired} RETURNING expires_at)"
            " SELECT count(*), max(expires_at), set_config('synchronous_commit', 'off', true)"
            " FROM gone"
        )

    def purge_batch(self, params: dict[str, Any]) -> SqlGen[tuple[int, Any]]:
        rows = yield Statement(self.purge_sql, params)
        count, latest = rows[0][:2] if rows else (0, None)
        return int(count), latest


# How long a waiter waits for a notification at most before it reserves again, though the
# record is in progress with a live lease: a settle that sends none (an older idempo's, a
# record evicted, a notification lost with its connection) costs at most this. Seconds.
RECHECK_SECONDS = 2.0
# How long it waits at most when it finds no record in progress that others can see: the
# holder may be an open transaction (transactional mode, whose record commits with its
# outcome), whose settle notifies it but whose rollback does not, and whose row lock the
# reservation that follows waits on. The flow's poll interval, so no faster. Seconds.
HOLDER_SECONDS = 0.05


class Watch:
    """A waiting duplicate's statements, in order, on one connection of its own in
    autocommit mode: `listen`; `lock`, the shared mark a settle looks for (it waits for a
    settle that took the mark first to commit, at most until the deadline); `check`, what
    the record is, read after the lock (a statement's snapshot is taken when it starts, so
    the lock and the read cannot be one statement); then the notification, for as long as
    `patience` says; then `unwatch`. A settle either meets the mark and notifies a listener,
    or holds the mark to its commit, which the lock then waits for, so the read sees it: no
    settle falls between the read and the wait. A failure on the way leaves the connection
    to be closed, which ends its LISTEN and lock with it."""

    def __init__(self, dialect: PostgresDialect, scope: Scope, deadline: float) -> None:
        self.deadline = deadline
        key = dialect.wake_key(scope)
        channel = f"idempo_wake_{key}"
        mark = f"{WAKE_CLASS}, {key}"
        # Numbers and a name of ours only: sent as text (several statements in one round
        # trip; the lock's timeout is the transaction's own, so the session's stays as set).
        self.listen = f"LISTEN {channel}"
        self.unwatch = f"SELECT pg_advisory_unlock_shared({mark}); UNLISTEN {channel}"
        # After the lock timed out: its transaction failed, and holds no lock.
        self.abandon = f"ROLLBACK; UNLISTEN {channel}"
        self.lock_at = f"pg_advisory_lock_shared({mark})"
        # 2: in progress, its lease live; 1: in progress, its lease over; 0: settled.
        self.check = (
            f"SELECT CASE WHEN state <> 'in_progress' THEN 0"
            " WHEN lease_expires_at > statement_timestamp() THEN 2 ELSE 1 END"
            f" FROM {dialect.table} WHERE {dialect.where_scope}"
        )
        self.params = dialect.scope_params(scope)

    def left(self) -> float:
        """Seconds until the deadline (0 once past it)."""
        return max(self.deadline - monotonic(), 0.0)

    def lock(self) -> str:
        """The shared lock on the mark, waiting no longer than what is left."""
        wait = pg_ms(timedelta(seconds=self.left()))
        return f"BEGIN; SET LOCAL lock_timeout = '{wait}'; SELECT {self.lock_at}; COMMIT"

    def patience(self, row: Any) -> float:
        """How long to wait for the notification, given what `check` read (``row``; None
        when there is no record that others can see): none once settled; `RECHECK_SECONDS`
        at most while in progress; `HOLDER_SECONDS` at most when the record may be an open
        transaction's (none yet, or a lease over, which a transactional takeover may hold)."""
        if row is not None and row[0] == 0:
            return 0.0
        bound = RECHECK_SECONDS if row is not None and row[0] == 2 else HOLDER_SECONDS
        return min(self.left(), bound)
