"""The MariaDB statements, for the generator protocol of `_sql` (any executor runs them).

The scope's primary key is a binary SHA-256 of ``(principal, operation, key)``: any scope fits
InnoDB's index limits, and lookups compare 32 bytes. Times are ``DATETIME(6)`` in UTC, exact
to the microsecond like Python's.

Reservation is one statement, ``INSERT ... ON DUPLICATE KEY UPDATE ... RETURNING``: it creates
the record, or takes over an expired one, or leaves it alone, under the row lock, and answers
with the row as it now is. ``RETURNING`` on ``INSERT`` (and ``SET STATEMENT ... FOR``) are
MariaDB's (10.5+); every other statement here also runs on MySQL 8.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any

from ..._core.digest import key_ref
from ..._core.keys import Scope
from ..._core.ops import Checkpoint, Release, Renew, Reserve, Settle
from ..._core.record import InProgress, Reservation
from ...errors import FencedError, StoreError
from .dialect import COLUMNS, SqlDialect, SqlGen, Statement
from .transaction import LockTimeoutError

__all__ = ["ROW_COUNT", "MySQLDialect", "scope_hash"]

# Asked right after a statement whose changed-row count decides something. An executor that
# already holds the count from the driver may answer it without a round trip.
ROW_COUNT = "SELECT ROW_COUNT()"

_WHERE_SCOPE = "scope_hash = :scope_hash"
# A purge counts at most this many expired index entries to choose its order (see _backlog):
# a table whose quarter is more is purged along expires_at.
_BACKLOG_COUNT_CAP = 4_000_000


def scope_hash(scope: Scope) -> bytes:
    """The record's primary key: SHA-256 over the length-prefixed parts of the scope."""
    principal, operation = scope.principal.encode(), scope.operation.encode()
    packed = b"%d:%s%d:%s%s" % (
        len(principal),
        principal,
        len(operation),
        operation,
        scope.key.encode(),
    )
    return hashlib.sha256(packed).digest()


# "Data truncated for column": a value the column cannot hold.
_DATA_TRUNCATED = 1265


def _truncated(exc: BaseException) -> bool:
    """Whether the driver error behind ``exc`` (its cause, or SQLAlchemy's ``orig``) is
    MariaDB's 1265."""
    seen: BaseException | None = exc
    while seen is not None:
        if seen.args[:1] == (_DATA_TRUNCATED,):
            return True
        seen = getattr(seen, "orig", None) or seen.__cause__
    return False


def lock_wait_seconds(timeout: timedelta) -> int:
    """``innodb_lock_wait_timeout`` counts whole seconds: round up, keep 0 (MariaDB: no wait)."""
    seconds = timeout.total_seconds()
    return 0 if seconds <= 0 else max(1, math.ceil(seconds))


class MySQLDialect(SqlDialect):
    """MariaDB (10.5+): reservation, takeover and the read of what is there in one statement.

    ``lock_wait``: seconds the reservation may wait on another transaction's row lock, sent
    with the statement itself (``SET STATEMENT``), so the app's own statements keep theirs.
    None: the session's setting.
    """

    name = "mysql"

    def __init__(self, table: str, lock_wait: int | None = None) -> None:
        super().__init__(table)
        self.lock_wait = lock_wait
        self._waiting: dict[int | None, MySQLDialect] = {}
        # Where a purge sweep in primary key order has got to (None: not in one).
        self._key_from: bytes | None = None

    def waiting(self, lock_wait: int | None) -> MySQLDialect:
        """This dialect with another lock wait (made once per value, then reused)."""
        clone = self._waiting.get(lock_wait)
        if clone is None:
            clone = copy.copy(self)
            clone.lock_wait = lock_wait
            clone.__dict__.pop("locking_reserve_sql", None)
            self._waiting[lock_wait] = clone
        return clone

    def db_time(self, value: datetime) -> Any:
        return value.astimezone(UTC).replace(tzinfo=None)

    def py_time(self, value: Any) -> datetime:
        result: datetime = value.replace(tzinfo=UTC)
        return result

    def ddl(self) -> list[str]:
        return [
            f"CREATE TABLE IF NOT EXISTS {self.table} ("
            " scope_hash BINARY(32) NOT NULL,"
            " principal TEXT NOT NULL, operation TEXT NOT NULL,"
            " idem_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
            " fingerprint TEXT NOT NULL,"
            " state ENUM('in_progress', 'completed', 'failed') NOT NULL,"
            " token BIGINT NOT NULL,"
            # Who made the last reservation: the statement that wrote it finds its own
            # random value there, and so knows it holds the key.
            " attempt BINARY(16) NOT NULL,"
            " lease_expires_at DATETIME(6) NULL, response LONGBLOB NULL,"
            " created_at DATETIME(6) NOT NULL, updated_at DATETIME(6) NOT NULL,"
            " expires_at DATETIME(6) NOT NULL, recovery_point TEXT NULL,"
            " PRIMARY KEY (scope_hash), KEY idempo_expires_at (expires_at))"
            # _bin: principals, operations and fingerprints compare and return byte for byte.
            " ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
            f"CREATE SEQUENCE IF NOT EXISTS {self.tokens}",
            # Past the largest token already stored (an install from before the sequence).
            # SETVAL never moves a sequence back, so running this again, or beside
            # reservations, is harmless; it takes a literal, hence the EXECUTE IMMEDIATE.
            "BEGIN NOT ATOMIC DECLARE m BIGINT;"
            f" SELECT MAX(token) INTO m FROM {self.table};"
            f" IF m > 0 THEN EXECUTE IMMEDIATE CONCAT('DO SETVAL({self.tokens}, ', m, ')');"
            " END IF; END",
        ]

    where_scope = _WHERE_SCOPE
    # UTC, whatever the session's time zone; like NOW(), the statement's start throughout.
    server_clock = "UTC_TIMESTAMP(6)"

    def cast_time(self, name: str) -> str:
        return f"CAST(:{name} AS DATETIME(6))"

    def plus(self, time: str, span: str) -> str:
        return f"({time} + INTERVAL :{span} MICROSECOND)"

    @property
    def next_token(self) -> str:
        # A missing sequence fails the statement with 1146, as a missing table does.
        return f"NEXTVAL({self.tokens})"

    def scope_params(self, scope: Scope) -> dict[str, Any]:
        return {**super().scope_params(scope), "scope_hash": scope_hash(scope)}

    @cached_property
    def reserve_sql(self) -> str:
        now = self.now
        # Free: retention over, or an expired lease retried with the same request.
        free = (
            f"(expires_at <= {now} OR (state = 'in_progress' AND lease_expires_at <= {now}"
            " AND fingerprint = :fingerprint))"
        )
        # MariaDB assigns left to right, so once `attempt` is ours the rest of the row may
        # already have changed; with SIMULTANEOUS_ASSIGNMENT every term sees the old row and
        # `free` still holds. Either way this is true exactly when the row is being taken.
        took = f"(attempt = :attempt OR {free})"

        def take(column: str, value: str) -> str:
            return f"{column} = IF({took}, {value}, {column})"

        # created_at and recovery_point read the old expires_at, so they come before it.
        fresh_history = f"{took} AND expires_at <= {now}"
        in_progress = "'in_progress'"
        lease_until, expires_at = self.plus(now, "lease"), self.plus(now, "lease_ttl")
        # The insert's token is the sequence's next value (drawn on every attempt: gaps are
        # harmless); a takeover's is the larger of it and the old token plus one.
        return (
            f"INSERT INTO {self.table} (scope_hash, principal, operation, idem_key,"
            " fingerprint, state, token, attempt, lease_expires_at, created_at, updated_at,"
            " expires_at)"
            " VALUES (:scope_hash, :principal, :operation, :key, :fingerprint, 'in_progress',"
            f" {self.next_token}, :attempt, {lease_until}, {now}, {now}, {expires_at})"
            f" ON DUPLICATE KEY UPDATE attempt = IF({free}, :attempt, attempt),"
            f" created_at = IF({fresh_history}, {now}, created_at),"
            f" recovery_point = IF({fresh_history}, NULL, recovery_point),"
            f" {take('token', 'GREATEST(token + 1, VALUES(token))')},"
            f" {take('fingerprint', ':fingerprint')},"
            f" {take('state', in_progress)}, {take('lease_expires_at', lease_until)},"
            f" {take('response', 'NULL')}, {take('updated_at', now)},"
            f" {take('expires_at', expires_at)}"
            # The instant it decided at, for judging what it found (the server's clock).
            f" RETURNING attempt = :attempt, {COLUMNS}, {now}"
        )

    @cached_property
    def locking_reserve_sql(self) -> str:
        if self.lock_wait is None:
            return self.reserve_sql
        return f"SET STATEMENT innodb_lock_wait_timeout = {self.lock_wait} FOR {self.reserve_sql}"

    def reserve(self, op: Reserve) -> SqlGen[Reservation]:
        # A fresh value per statement: a value the row already holds would take it again.
        params = {**self.reserve_params(op), "attempt": os.urandom(16)}
        try:
            rows = yield Statement(self.locking_reserve_sql, params)
        except StoreError as exc:
            if not _truncated(exc):
                raise
            # The row holds a value its own column refuses (an ENUM's '' after a lax
            # write), so even writing it back unchanged fails: say what the row is.
            found = yield Statement(self.select_sql, self.scope_params(op.scope))
            if found:
                self.record(found[0], op.scope)  # raises CorruptRecordError
            raise
        # The statement read the row under its lock, so what it found is final; the Python
        # judge agrees with the SQL one, so None cannot happen short of a clock going back.
        return self.judge_rows(rows, op) or InProgress(retry_after=0.0)

    def settle(self, op: Settle) -> SqlGen[None]:
        # The row always changes (its state does), so a count of 0 means a stale token or a
        # settle repeated; the error raised for a stale one rolls the caller's transaction
        # back before anything commits.
        yield Statement(self.settle_update, self.settle_params(op), fetch=False)
        rows = yield Statement(ROW_COUNT, {})
        if not rows or not rows[0][0]:
            yield from self.settled_already(op)

    def renew(self, op: Renew) -> SqlGen[None]:
        # Counted as rows matched, not changed: the store's connections set CLIENT_FOUND_ROWS,
        # and renew runs only there, so renewing twice in one microsecond is not "stale".
        update = Statement(self.renew_update, self.renew_params(op), fetch=False)
        yield from self._fenced(
            update, f"cannot renew {key_ref(op.scope.key)}: token {op.token} is stale"
        )

    def _fenced(self, update: Statement, stale: str) -> SqlGen[None]:
        """Run a fenced UPDATE; no row counted means the token was stale."""
        yield update
        rows = yield Statement(ROW_COUNT, {})
        if not rows or not rows[0][0]:
            raise FencedError(stale)

    def checkpoint(self, op: Checkpoint) -> SqlGen[None]:
        yield Statement(self.checkpoint_update, self.checkpoint_params(op), fetch=False)
        rows = yield Statement(ROW_COUNT, {})
        if rows and rows[0][0]:
            return
        # No row changed. On the app's connection rows are counted as changed, not matched
        # (no CLIENT_FOUND_ROWS there), and the same checkpoint twice on one injected clock
        # changes nothing: only a record this token no longer holds is stale.
        held = yield Statement(
            f"SELECT 1 FROM {self.table} WHERE {_WHERE_SCOPE}"
            " AND token = :token AND state = 'in_progress'",
            {"scope_hash": scope_hash(op.scope), "token": op.token},
        )
        if not held:
            raise FencedError(
                f"cannot record step of {key_ref(op.scope.key)}: token {op.token} is stale"
            )

    def release(self, op: Release) -> SqlGen[None]:
        yield Statement(
            f"DELETE FROM {self.table} WHERE {_WHERE_SCOPE}{self.release_where}",
            {"scope_hash": scope_hash(op.scope), "token": op.token},
            fetch=False,
        )

    @cached_property
    def select_sql(self) -> str:
        return f"SELECT {COLUMNS} FROM {self.table} WHERE {_WHERE_SCOPE}"

    def purge(self, before: datetime | None, limit: int) -> SqlGen[int]:
        """Delete up to ``limit`` expired records: along the expires_at index (`SqlDialect`),
        or, through a backlog, in primary key order (see `_backlog`)."""
        if self._key_from is None:
            sweep_starts = self.purge_resume is None
            count = yield from super().purge(before, limit)
            # Only a sweep whose first batch came back full asks: a purge that finds little
            # costs what it did.
            if sweep_starts and count == limit and (yield from self._backlog(before, limit)):
                self.purge_resume, self._key_from = None, b""
            return count
        count = 0
        # Batches that come up short with the walk not over (rows held by others were
        # spared) walk on, so a short answer still means the purge is done.
        while self._key_from is not None and count < limit:
            params = {**self.purge_params(before, limit - count), "after": self._key_from}
            deleted, self._key_from = yield from self._key_batch(params)
            count += deleted
        if count < limit:
            # The walk reached the end of the table. What it left (rows held as it passed,
            # records that expired behind it) is looked for along expires_at from the
            # oldest, as at the end of a sweep in that order.
            count += yield from super().purge(before, limit - count)
        return count

    def _backlog(self, before: datetime | None, limit: int) -> SqlGen[bool]:
        """Whether the rest of a sweep should walk the table in primary key order: at least
        a batch, and at least a quarter of the table (InnoDB's row estimate), is expired.

        Along expires_at each record of a batch sits on a page of its own (the primary key
        is a hash), read and dirtied for that one row; in key order a page's rows go
        together, which on a backlog is 1.6-3x the records/s and a fraction of the pages
        (benchmarks.md). On a routine purge (1 in 24 expired) key order would read about
        the whole table for a few rows a page, so it is only chosen on a backlog. The count
        stops at the quarter: it never reads more index entries than the purge will delete.
        """
        schema, _, name = self.table.rpartition(".")
        rows = yield Statement(
            "SELECT TABLE_ROWS FROM information_schema.TABLES"
            " WHERE TABLE_SCHEMA = COALESCE(:schema, DATABASE()) AND TABLE_NAME = :name",
            {"schema": schema or None, "name": name},
        )
        estimate = int(rows[0][0] or 0) if rows else 0
        enough = max(limit, -(-estimate // 4))
        if enough > _BACKLOG_COUNT_CAP:
            return False
        counted = yield Statement(
            f"SELECT COUNT(*) FROM (SELECT 1 FROM {self.table}"
            f" WHERE expires_at <= {self.time_param('before')} LIMIT :enough) AS e",
            {**self.purge_params(before, limit), "enough": enough},
        )
        return counted is not None and int(counted[0][0]) >= enough

    def _key_batch(self, params: dict[str, Any]) -> SqlGen[tuple[int, bytes | None]]:
        """One batch in primary key order past ``params["after"]``: how many records it
        deleted, and the last key it passed (None: it reached the end of the table).

        One statement, which deletes the first ``limit`` expired rows it meets, each checked
        under its row lock. It waits on no lock: a row another transaction holds (a
        takeover under way) fails it at once, rolled back whole, and the batch is then
        picked skipping held rows and deleted by key, as along expires_at."""
        try:
            rows = yield Statement(
                "SET STATEMENT innodb_lock_wait_timeout = 0 FOR"
                f" DELETE FROM {self.table} WHERE scope_hash > :after AND {self.expired}"
                " ORDER BY scope_hash LIMIT :limit RETURNING scope_hash",
                params,
            )
        except LockTimeoutError:
            picked = yield Statement(
                f"SELECT scope_hash FROM {self.table} WHERE scope_hash > :after"
                f" AND {self.expired} ORDER BY scope_hash LIMIT :limit FOR UPDATE SKIP LOCKED",
                params,
            )
            if not picked:
                return 0, None
            count = yield from self._delete_picked([row[0] for row in picked], params)
            return count, (picked[-1][0] if len(picked) == params["limit"] else None)
        rows = rows or []
        return len(rows), (rows[-1][0] if len(rows) == params["limit"] else None)

    def purge_batch(self, params: dict[str, Any]) -> SqlGen[tuple[int, Any]]:
        # Oldest first along the expires_at index; a live lease is never purged. Rows another
        # transaction holds (a takeover under way) are skipped, not waited for; the DELETE
        # states the conditions again and reads each row under its lock, so a row taken over
        # between the two statements is spared.
        rows = yield Statement(
            f"SELECT scope_hash, expires_at FROM {self.table} WHERE {self.purgeable}"
            " ORDER BY expires_at, scope_hash LIMIT :limit FOR UPDATE SKIP LOCKED",
            params,
        )
        if not rows:
            return 0, None
        count = yield from self._delete_picked([row[0] for row in rows], params)
        # The latest expiry picked, deleted or spared: the sweep has passed it either way.
        return count, max(row[1] for row in rows)

    def _delete_picked(self, hashes: list[bytes], params: dict[str, Any]) -> SqlGen[int]:
        """Delete the picked records that are still expired, each read under its lock."""
        # Parameter names are letters only (see _sql.pyformat): h_a, h_b, ..., h_ba, ...
        names = ["h_" + "".join(chr(97 + int(d)) for d in str(i)) for i in range(len(hashes))]
        params = {**params, **dict(zip(names, hashes, strict=True))}
        # By primary key only (a multi-table DELETE, which takes an index hint): a scan,
        # which MariaDB prefers on a small table, would wait on the rows SKIP LOCKED left out.
        yield Statement(
            f"DELETE r FROM {self.table} AS r FORCE INDEX (PRIMARY)"
            f" WHERE r.scope_hash IN ({', '.join(':' + name for name in names)})"
            f" AND {self.expired}",
            params,
            fetch=False,
        )
        counted = yield Statement(ROW_COUNT, {})
        return int(counted[0][0]) if counted else 0

    def evict(self, scope: Scope) -> SqlGen[bool]:
        rows = yield Statement(
            f"DELETE FROM {self.table} WHERE {_WHERE_SCOPE} RETURNING 1",
            {"scope_hash": scope_hash(scope)},
        )
        return bool(rows)
