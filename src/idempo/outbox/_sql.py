"""The outbox's SQL, sans I/O: the table per database, staging, claiming, settling, purge and
stats, as generators of `Statement`s that any executor of the stores runs.

Times and durations go through the records dialect of the same database (`SqlDialect`), so
the outbox keeps time as the records do: the server's clock on PostgreSQL and MariaDB unless
a clock was injected, the host's on SQLite (integer microseconds).

    sql = OutboxSql.of("postgresql", "app.idempo_outbox")
    for statement in sql.ddl(): ...
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache, cached_property
from typing import Any, TypeVar

from .._core.digest import key_ref
from .._core.keys import Scope
from ..errors import ConfigurationError, CorruptRecordError
from ..stores import _clock
from ..stores._sql.dialect import SqlDialect, SqlGen, Statement, derived_name
from ..stores._sql.mysql import ROW_COUNT, MySQLDialect
from ..stores._sql.postgres import PostgresDialect
from ..stores._sql.sqlite import SQLiteDialect
from ._message import OutboxMessage

__all__ = ["DEFAULT_TABLE", "OutboxSql", "Publish", "outbox_table"]

T = TypeVar("T")

DEFAULT_TABLE = "idempo_outbox"
# The longest error text kept per message: enough to say why, never a whole traceback.
_ERROR_CHARS = 2000

_DIALECTS: dict[str, type[SqlDialect]] = {
    "postgresql": PostgresDialect,
    "sqlite": SQLiteDialect,
    "mysql": MySQLDialect,
}


def outbox_table(records_table: str) -> str:
    """The default outbox table beside a records table, in the same schema.

    >>> outbox_table("app.idempo_records"), outbox_table("idempo_records")
    ('app.idempo_outbox', 'idempo_outbox')
    """
    schema, dot, _ = records_table.rpartition(".")
    return f"{schema}{dot}{DEFAULT_TABLE}"


@dataclass(frozen=True, slots=True)
class Publish:
    """The relay's one operation that is not SQL: publish these messages, in order, while
    the claim's transaction is open (PostgreSQL, MariaDB). The answer maps the id of each
    message that was not confirmed to why (None: it was not tried); the others were."""

    messages: tuple[OutboxMessage, ...]


RelayGen = Generator[Statement | Publish, Any, T]

_COLUMNS = "id, destination, body, headers, attempts"


def _names(prefix: str, count: int) -> list[str]:
    """Parameter names of letters only (the executors' ``:name`` rule): id_a, id_b, ..."""
    return [f"{prefix}_" + "".join(chr(97 + int(d)) for d in str(i)) for i in range(count)]


class OutboxSql:
    """The statements of one outbox table on one database (``name``: the records dialect's
    name, ``postgresql``, ``sqlite`` or ``mysql``)."""

    def __init__(self, name: str, table: str) -> None:
        kind = _DIALECTS.get(name)
        if kind is None:
            raise ConfigurationError(f"the outbox has no SQL for {name!r} databases")
        # The records dialect for this database, used for its time handling only (its table
        # is the outbox's: it validates the name).
        self.dialect: SqlDialect = kind(table)
        self.name = name
        self.table = table
        # PostgreSQL and MariaDB lock claimed rows for the transaction that publishes them;
        # SQLite (one writer for the whole file) leases them instead, see `claim`.
        self.locks = name != "sqlite"

    @staticmethod
    @cache
    def of(name: str, table: str) -> OutboxSql:
        """The statements for ``table`` on database ``name`` (made once, then shared)."""
        return OutboxSql(name, table)

    # -- time -----------------------------------------------------------------------------
    def now_value(self, now: datetime | None) -> Any:
        """``now`` as the statements take it: None (the server's clock) where there is one,
        else the host's time when none was injected."""
        if now is None and not self.dialect.server_clock:
            now = _clock.host_now()
        return self.dialect.time_value(now)

    @cached_property
    def _now(self) -> str:
        return self.dialect.time_param("now")

    def _plus(self, span: str) -> str:
        return self.dialect.plus(self._now, span)

    # -- schema ---------------------------------------------------------------------------
    def ddl(self) -> list[str]:
        """The table and its two indexes: due pending rows (what a relay claims) and sent
        rows by age (what purge deletes)."""
        table = self.table
        pending, sent = derived_name(table, "due"), derived_name(table, "sent")
        if self.name == "postgresql":
            return [
                f"CREATE TABLE IF NOT EXISTS {table} ("
                " id text PRIMARY KEY, principal text NOT NULL, operation text NOT NULL,"
                " idem_key text NOT NULL, label text NOT NULL, destination text NOT NULL,"
                " body bytea NOT NULL, headers text NOT NULL,"
                " created_at timestamptz NOT NULL, available_at timestamptz NOT NULL,"
                " attempts integer NOT NULL DEFAULT 0, sent_at timestamptz, last_error text)",
                # Partial: the pending rows stay a small index however many were sent.
                f"CREATE INDEX IF NOT EXISTS {pending.rsplit('.', 1)[-1]} ON {table}"
                " (available_at) WHERE sent_at IS NULL",
                f"CREATE INDEX IF NOT EXISTS {sent.rsplit('.', 1)[-1]} ON {table}"
                " (sent_at) WHERE sent_at IS NOT NULL",
            ]
        if self.name == "sqlite":
            return [
                f"CREATE TABLE IF NOT EXISTS {table} ("
                " id TEXT PRIMARY KEY, principal TEXT NOT NULL, operation TEXT NOT NULL,"
                " idem_key TEXT NOT NULL, label TEXT NOT NULL, destination TEXT NOT NULL,"
                " body BLOB NOT NULL, headers TEXT NOT NULL,"
                " created_at INTEGER NOT NULL, available_at INTEGER NOT NULL,"
                " attempts INTEGER NOT NULL DEFAULT 0, sent_at INTEGER, last_error TEXT)",
                f"CREATE INDEX IF NOT EXISTS {pending} ON {table} (available_at)"
                " WHERE sent_at IS NULL",
                f"CREATE INDEX IF NOT EXISTS {sent} ON {table} (sent_at) WHERE sent_at IS NOT NULL",
            ]
        # MariaDB has no partial index: (sent_at, available_at) serves both, the pending
        # rows being the ones whose sent_at IS NULL.
        return [
            f"CREATE TABLE IF NOT EXISTS {table} ("
            " id VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
            " principal TEXT NOT NULL, operation TEXT NOT NULL,"
            " idem_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
            " label TEXT NOT NULL, destination TEXT NOT NULL, body LONGBLOB NOT NULL,"
            " headers TEXT NOT NULL, created_at DATETIME(6) NOT NULL,"
            " available_at DATETIME(6) NOT NULL, attempts INT NOT NULL DEFAULT 0,"
            " sent_at DATETIME(6) NULL, last_error TEXT NULL,"
            f" PRIMARY KEY (id), KEY {pending.rsplit('.', 1)[-1]} (sent_at, available_at))"
            " ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
        ]

    # -- staging --------------------------------------------------------------------------
    @cached_property
    def insert_sql(self) -> str:
        # The same id again is kept as first staged, never an error that would abort the
        # app's transaction; `stage` then compares it with what was asked. MariaDB returns
        # the row as it now is (new or old), PostgreSQL and SQLite only a new one.
        conflict = (
            " ON DUPLICATE KEY UPDATE id = id"
            if self.name == "mysql"
            else " ON CONFLICT (id) DO NOTHING"
        )
        return (
            f"INSERT INTO {self.table} (id, principal, operation, idem_key, label,"
            " destination, body, headers, created_at, available_at, attempts)"
            " VALUES (:id, :principal, :operation, :key, :label, :destination, :body,"
            f" :headers, {self._now}, {self._now}, 0){conflict}"
            " RETURNING destination, body, headers"
        )

    def stage(
        self, message: OutboxMessage, scope: Scope, label: str, now: datetime | None
    ) -> SqlGen[None]:
        """Insert ``message``, staged by ``scope``, in the transaction this runs in.

        Its id there already (a step that stages it again after its first staging
        committed) is fine when it is the same message; another message under that id would
        be lost without a word, so that is a `ConfigurationError` (the labels clash).
        """
        headers = json.dumps(dict(message.headers), separators=(",", ":"))
        rows = yield Statement(
            self.insert_sql,
            {
                "id": message.id,
                "principal": scope.principal,
                "operation": scope.operation,
                "key": scope.key,
                "label": label,
                "destination": message.destination,
                "body": message.body,
                "headers": headers,
                "now": self.now_value(now),
            },
        )
        if not rows:
            rows = yield Statement(
                f"SELECT destination, body, headers FROM {self.table} WHERE id = :id",
                {"id": message.id},
            )
        found = rows[0] if rows else None
        if found is not None and (found[0], bytes(found[1]), found[2]) == (
            message.destination,
            message.body,
            headers,
        ):
            return
        raise ConfigurationError(
            f"message {label!r} of {key_ref(scope.key)} (operation {scope.operation!r}) is"
            f" staged already with another destination, body or headers (id {message.id}):"
            " give each message of the work its own label"
        )

    # -- the relay ------------------------------------------------------------------------
    @cached_property
    def _due(self) -> str:
        return f"sent_at IS NULL AND available_at <= {self._now}"

    @cached_property
    def claim_locked_sql(self) -> str:
        # SKIP LOCKED: rows another relay holds are its own; this one takes the next ones.
        return (
            f"SELECT {_COLUMNS} FROM {self.table} WHERE {self._due}"
            " ORDER BY available_at, id LIMIT :limit FOR UPDATE SKIP LOCKED"
        )

    @cached_property
    def claim_leased_sql(self) -> str:
        return (
            f"UPDATE {self.table} SET available_at = {self._plus('lease')}"
            f" WHERE id IN (SELECT id FROM {self.table} WHERE {self._due}"
            " ORDER BY available_at, id LIMIT :limit)"
            f" RETURNING {_COLUMNS}, created_at"
        )

    def claim(
        self, limit: int, now: datetime | None, lease: timedelta
    ) -> SqlGen[list[OutboxMessage]]:
        """Claim up to ``limit`` due messages, oldest first.

        PostgreSQL and MariaDB: the rows are locked until the transaction this runs in ends,
        which is after they are published and marked (`batch`). SQLite: the rows are moved
        ``lease`` into the future in a short write transaction of their own, so no other
        relay claims them meanwhile and the app's writers are not held while the broker
        answers; marking them is a second transaction (`settle`).
        """
        params = {"now": self.now_value(now), "limit": int(limit)}
        if self.locks:
            rows = yield Statement(self.claim_locked_sql, params)
        else:
            params["lease"] = self.dialect.db_span(lease)
            rows = yield Statement(self.claim_leased_sql, params)
            # RETURNING has no order: put them back in the order they were staged.
            rows = sorted(rows or (), key=lambda row: (row[5], row[0]))
        return [self._message(row) for row in rows or ()]

    def _message(self, row: Sequence[Any]) -> OutboxMessage:
        id_, destination, body, headers, attempts = row[:5]
        try:
            decoded = json.loads(headers)
            if not isinstance(decoded, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in decoded.items()
            ):
                raise TypeError("the headers are not an object of strings")
        except (ValueError, TypeError) as exc:
            raise CorruptRecordError(
                f"outbox message {id_!r} in {self.table} has unreadable headers ({exc});"
                f" fix or delete the row"
            ) from exc
        return OutboxMessage(str(id_), str(destination), bytes(body), decoded, int(attempts))

    def settle(
        self,
        sent: Sequence[str],
        failed: Mapping[str, tuple[str, timedelta]],
        released: Sequence[str],
        now: datetime | None,
    ) -> SqlGen[None]:
        """Mark ``sent`` as sent; give each of ``failed`` (id -> why, and the delay before
        its next try) its error, one more try and its next time; make ``released`` (claimed,
        never tried) due again at once, where a claim leased them (SQLite)."""
        when = self.now_value(now)
        if sent:
            yield self._each(
                f"UPDATE {self.table} SET sent_at = {self._now}, attempts = attempts + 1,"
                " last_error = NULL WHERE sent_at IS NULL AND id IN",
                sent,
                when,
            )
        if released and not self.locks:
            yield self._each(
                f"UPDATE {self.table} SET available_at = {self._now}"
                " WHERE sent_at IS NULL AND id IN",
                released,
                when,
            )
        for id_, (error, delay) in failed.items():
            yield Statement(
                f"UPDATE {self.table} SET attempts = attempts + 1, last_error = :error,"
                f" available_at = {self._plus('delay')} WHERE id = :id AND sent_at IS NULL",
                {
                    "id": id_,
                    "error": error[:_ERROR_CHARS],
                    "now": when,
                    "delay": self.dialect.db_span(delay),
                },
                fetch=False,
            )

    @staticmethod
    def _each(sql: str, ids: Sequence[str], now: Any) -> Statement:
        """``sql`` (ending in ``IN``) over the list ``ids``."""
        names = _names("id", len(ids))
        params: dict[str, Any] = dict(zip(names, ids, strict=True))
        params["now"] = now
        return Statement(f"{sql} ({', '.join(':' + n for n in names)})", params, fetch=False)

    # -- retention and stats --------------------------------------------------------------
    def purge(self, retention: timedelta, limit: int, now: datetime | None = None) -> SqlGen[int]:
        """Delete up to ``limit`` messages sent more than ``retention`` before ``now`` (the
        store's clock when None), oldest first. Pending messages are never purged."""
        old = f"sent_at IS NOT NULL AND sent_at <= {self._plus('back')}"
        params = {
            "now": self.now_value(now),
            "back": self.dialect.db_span(-retention),
            "limit": int(limit),
        }
        if self.name == "mysql":
            # Sent rows are never locked by a relay (it claims pending ones only).
            yield Statement(
                f"DELETE FROM {self.table} WHERE {old} ORDER BY sent_at LIMIT :limit",
                params,
                fetch=False,
            )
            counted = yield Statement(ROW_COUNT, {})
            return int(counted[0][0]) if counted else 0
        rows = yield Statement(
            f"DELETE FROM {self.table} WHERE id IN (SELECT id FROM {self.table}"
            f" WHERE {old} ORDER BY sent_at LIMIT :limit) RETURNING 1",
            params,
        )
        return len(rows or ())

    def stats(self) -> SqlGen[dict[str, int]]:
        """The backlog: ``pending`` (not sent yet), ``failing`` (pending, tried at least
        once), ``sent`` (kept until purged)."""
        rows = yield Statement(
            "SELECT COALESCE(SUM(CASE WHEN sent_at IS NULL THEN 1 ELSE 0 END), 0),"
            " COALESCE(SUM(CASE WHEN sent_at IS NULL AND attempts > 0 THEN 1 ELSE 0 END), 0),"
            f" COALESCE(SUM(CASE WHEN sent_at IS NULL THEN 0 ELSE 1 END), 0) FROM {self.table}",
            {},
        )
        pending, failing, sent = rows[0] if rows else (0, 0, 0)
        return {"pending": int(pending), "failing": int(failing), "sent": int(sent)}

    # -- one batch under one transaction (PostgreSQL, MariaDB) -----------------------------
    def batch(
        self, limit: int, now: datetime | None, delay: Callable[[OutboxMessage], timedelta]
    ) -> RelayGen[tuple[int, int]]:
        """Claim, publish and settle up to ``limit`` messages in the one transaction this
        runs in: ``(sent, failed)``. ``delay(message)`` is the wait before a failed
        message's next try."""
        messages = yield from self.claim(limit, now, timedelta(0))
        if not messages:
            return 0, 0
        failures: Mapping[str, str | None] = yield Publish(tuple(messages))
        yield from self.settle_published(messages, failures, now, delay)
        failed = sum(1 for why in failures.values() if why is not None)
        return len(messages) - len(failures), failed

    def settle_published(
        self,
        messages: Sequence[OutboxMessage],
        failures: Mapping[str, str | None],
        now: datetime | None,
        delay: Callable[[OutboxMessage], timedelta],
    ) -> SqlGen[None]:
        """`settle` after a `Publish` answered ``failures`` (id -> why; None: not tried)."""
        sent = [m.id for m in messages if m.id not in failures]
        failed = {
            m.id: (why, delay(m)) for m in messages if (why := failures.get(m.id)) is not None
        }
        released = [m.id for m in messages if m.id in failures and failures[m.id] is None]
        yield from self.settle(sent, failed, released, now)
