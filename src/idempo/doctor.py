"""``idempo doctor``: check what exactly-once depends on in a store, and say what to change.

A record that the store acknowledged and then lost (an unsynced commit, an evicted key, a
restart without persistence), a schema that is missing or older than the code, a clock that
disagrees with the store's, a retention shorter than the time retries keep coming: each turns
a retry into a second execution. `diagnose` looks for each and returns `Finding`s; the CLI
only prints them.

    >>> report = diagnose("memory://")
    >>> [(f.check, f.level.value) for f in report.findings][:1]
    [('durability', 'fail')]
    >>> report.exit_code
    2

Exit codes (``idempo doctor``): 0 every check passed, 1 at least one warning, 2 at least one
failure. A store the doctor cannot reach or open is an error of the command (exit 3).

.. versionadded:: 0.2
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from ._core.record import Status
from .errors import ConfigurationError
from .policy import Policy
from .stores import open_store
from .stores._sql.dialect import COLUMNS, Statement

__all__ = [
    "EXPECTED_COLUMNS",
    "Finding",
    "Level",
    "Report",
    "diagnose",
    "parse_duration",
]

EXPECTED_COLUMNS = tuple(name.strip() for name in COLUMNS.split(","))
"""The columns of the records table every SQL store reads and writes."""
_MYSQL_COLUMNS = ("scope_hash", "attempt")  # MariaDB's primary key and reservation marker

SKEW_WARN = timedelta(seconds=1)
"""A host clock further than this from the store's is reported (a warning)."""
SKEW_FAIL = Policy().lease
"""...and further than the default lease, a failure: leases would end early or late."""


class Level(StrEnum):
    """How a check came out."""

    PASS = "pass"  # noqa: S105 - a level, not a password
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Finding:
    """One check: what was found (``summary``, the raw ``value``), and what to change."""

    check: str
    level: Level
    summary: str
    fix: str | None = None
    value: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "check": self.check,
            "level": self.level.value,
            "summary": self.summary,
            "fix": self.fix,
            "value": self.value,
        }


@dataclass(frozen=True, slots=True)
class Report:
    """What `diagnose` found about one store."""

    store: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0 all passed, 1 a warning, 2 a failure."""
        levels = {finding.level for finding in self.findings}
        return 2 if Level.FAIL in levels else 1 if Level.WARN in levels else 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (what ``idempo doctor --json`` prints)."""
        return {
            "store": self.store,
            "exit_code": self.exit_code,
            "findings": [finding.as_dict() for finding in self.findings],
        }


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``"90s"``, ``"5m"``, ``"24h"``, ``"7d"``, ``"2w"`` (a bare number is seconds).

    >>> parse_duration("7d"), parse_duration("1.5h")
    (datetime.timedelta(days=7), datetime.timedelta(seconds=5400))
    """
    found = _DURATION.match(text)
    if not found:
        raise ConfigurationError(
            f"{text!r} is not a duration: a number and a unit, e.g. 90s, 5m, 24h, 7d"
        )
    return timedelta(seconds=float(found.group(1)) * _UNITS[found.group(2) or "s"])


def _span(delta: timedelta) -> str:
    """A duration as people read it: 7d, 24h, 90s."""
    seconds = delta.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def diagnose(
    url: str,
    *,
    horizon: timedelta | None = None,
    retention: timedelta | None = None,
    clock: Callable[[], datetime] | None = None,
    **options: Any,
) -> Report:
    """Check the store at ``url``; it is opened read-only and nothing is written or created.

    Args:
        horizon: how long after a first attempt retries may still come (a client's retry
            budget, a queue's redelivery window); the retention must cover it.
        retention: the app's ``Policy(ttl=...)``; default: what the stored records show,
            else the default policy's 24 h.
        clock: this host's clock (tests inject one to show skew).
        options: go to the store's constructor (``table=...``).

    Raises `StoreUnavailableError` (and its kin) when the store cannot be reached or opened.
    """
    store = open_store(url, read_only=True, **options)
    try:
        inner = getattr(store, "store", store)  # through the local cache tier
        kind, checks = _checks_for(inner, clock or (lambda: datetime.now(UTC)))
        findings = list(checks)
        # The records cannot be read from a table that is missing or older than the code.
        readable = all(f.level is Level.PASS for f in findings if f.check == "schema")
        findings.append(_retention(inner if readable else None, horizon, retention))
        return Report(kind, findings)
    finally:
        store.close()


def _checks_for(store: Any, clock: Callable[[], datetime]) -> tuple[str, Iterator[Finding]]:
    name = type(store).__name__
    if name == "PostgresStore":
        return "postgresql", _postgres(store, clock)
    if name == "MySQLStore":
        return "mariadb", _mysql(store, clock)
    if name == "SQLiteStore":
        return "sqlite", _sqlite(store)
    if name == "RedisStore":
        return "redis", _redis(store, clock)
    if name == "MemoryStore":
        return "memory", iter([_memory()])
    return name, iter(
        [Finding("store", Level.WARN, f"the doctor knows no checks for a {name}", None, name)]
    )


# -- running statements on a SQL store (read only, through its own connections) ------------


def _query(store: Any, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    def gen() -> Generator[Statement, Any, list[tuple[Any, ...]]]:
        rows = yield Statement(sql, params or {})
        return list(rows or ())

    rows: list[tuple[Any, ...]] = store.read(gen())
    return rows


def _timed(
    clock: Callable[[], datetime], read: Callable[[], datetime]
) -> tuple[timedelta, timedelta]:
    """The store's clock minus this host's, and the uncertainty (half the round trip)."""
    before = clock()
    theirs = read()
    after = clock()
    half = (after - before) / 2
    return theirs - (before + half), half


def _skew(store_name: str, offset: timedelta, uncertainty: timedelta) -> Finding:
    size = abs(offset) - uncertainty  # what is off for certain
    shown = f"{offset.total_seconds():+.3f}s (±{uncertainty.total_seconds():.3f}s)"
    value = f"{offset.total_seconds():+.6f}"
    if size <= SKEW_WARN:
        return Finding("clock", Level.PASS, f"{store_name}'s clock and this host's agree: {shown}",
                       None, value)  # fmt: skip
    fix = (
        "run NTP (chrony, systemd-timesyncd) on this host and on the store's; leases and"
        " retention are decided on the store's clock, but an app that injects a clock"
        " (Policy(clock=...)), `idempo evict`/`resolve` (which judge a live lease) and"
        " `purge --before` use this host's"
    )
    level = Level.FAIL if size > SKEW_FAIL else Level.WARN
    return Finding("clock", level, f"{store_name}'s clock is off from this host's by {shown}",
                   fix, value)  # fmt: skip


def _schema(
    store: Any, present: set[str] | None, tokens_found: bool, extra: tuple[str, ...] = ()
) -> Finding:
    table = store.dialect.table
    if not present:
        return Finding(
            "schema",
            Level.FAIL,
            f"the records table {table} does not exist: the store is not migrated",
            "run `idempo migrate URL` (or store.migrate()) once, before the app starts",
            "missing",
        )
    missing = [c for c in (*EXPECTED_COLUMNS, *extra) if c not in present]
    if missing:
        fix = "the table predates this version of idempo: add the missing columns"
        if missing == ["recovery_point"]:
            kind = "text" if store.dialect.name != "mysql" else "TEXT NULL"
            fix = f"ALTER TABLE {table} ADD COLUMN recovery_point {kind}"
        return Finding(
            "schema",
            Level.FAIL,
            f"the records table {table} lacks columns: {', '.join(missing)}",
            fix,
            ",".join(missing),
        )
    if not tokens_found:
        return Finding(
            "schema",
            Level.FAIL,
            f"the token counter {store.dialect.tokens} does not exist",
            "run `idempo migrate URL`: it creates the counter past the largest stored token",
            "no-tokens",
        )
    return Finding("schema", Level.PASS, f"{table} and its token counter are current", None, "ok")


def _split(table: str) -> tuple[str | None, str]:
    schema, _, name = table.rpartition(".")
    return schema or None, name


# -- PostgreSQL ------------------------------------------------------------------------------


def _postgres(store: Any, clock: Callable[[], datetime]) -> Iterator[Finding]:
    (sync, fsync), *_ = _query(
        store, "SELECT current_setting('synchronous_commit'), current_setting('fsync')"
    )
    if fsync != "on":
        yield Finding(
            "fsync",
            Level.FAIL,
            "fsync is off: a server or machine crash can lose committed records, or the"
            " whole database",
            "set fsync = on in postgresql.conf and reload (never off in production)",
            str(fsync),
        )
    else:
        yield Finding("fsync", Level.PASS, "fsync is on", None, "on")
    if sync == "off":
        yield Finding(
            "synchronous_commit",
            Level.FAIL,
            "synchronous_commit is off for the store's sessions: a server crash loses the last"
            " commits it acknowledged (records of work that ran), and retries run it again",
            "ALTER ROLE <the store's role> SET synchronous_commit = on (or ALTER DATABASE, or"
            " postgresql.conf); check the role, the database and the URL's options",
            "off",
        )
    else:
        yield Finding(
            "synchronous_commit",
            Level.PASS,
            f"synchronous_commit is {sync}: a commit is on disk before it is acknowledged",
            None,
            str(sync),
        )
    schema, name = _split(store.dialect.table)
    columns = _query(
        store,
        "SELECT column_name FROM information_schema.columns WHERE table_name = :name"
        " AND table_schema = COALESCE(CAST(:schema AS text), current_schema())",
        {"name": name, "schema": schema},
    )
    (tokens,), *_ = _query(
        store, "SELECT to_regclass(:sequence) IS NOT NULL", {"sequence": store.dialect.tokens}
    )
    found = _schema(store, {str(c) for (c,) in columns}, bool(tokens))
    yield found
    if found.level is Level.PASS:
        yield _reserve_function(store)
    offset, half = _timed(
        clock, lambda: _query(store, "SELECT clock_timestamp()")[0][0].astimezone(UTC)
    )
    yield _skew("PostgreSQL", offset, half)


def _reserve_function(store: Any) -> Finding:
    dialect = store.dialect
    found = _query(
        store,
        "SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure(:signature)",
        {"signature": dialect.signature},
    )
    name = f"the reservation function {dialect.function}"
    ((earlier,),) = _query(
        store,
        "SELECT to_regprocedure(:signature) IS NOT NULL",
        {"signature": dialect.earlier_signature},
    )
    if found and str(found[0][0]).strip() == dialect.function_body.strip():
        summary = f"{name} is current"
        if earlier:
            # Left by `migrate` for the earlier version's processes (a rolling deploy):
            # nothing is wrong, but only the operator knows when none of them runs.
            summary += (
                f"; the earlier version's {dialect.earlier_signature} is still there for"
                " its processes: once none runs, it can be dropped (docs/stores.md)"
            )
        return Finding("reserve_function", Level.PASS, summary, None, "ok")
    fix = "run `idempo migrate URL` again: it makes the function and changes nothing else"
    if found:
        why = f"{name} is not this version's (another version of idempo made it)"
        return Finding("reserve_function", Level.WARN, why, fix, "outdated")
    if earlier:
        why = (
            f"{name} is an earlier version's (seven parameters, no lock timeout): until this"
            " version's is made, every reservation sends the reservation statement (correct,"
            " and slower)"
        )
        return Finding("reserve_function", Level.WARN, why, fix, "outdated")
    why = (
        f"{name} is missing (the table was migrated before it): every replay costs the"
        " server the reservation statement's insert and update, set up for nothing"
        " (correct, and slower)"
    )
    return Finding("reserve_function", Level.WARN, why, fix, "missing")


# -- MariaDB ---------------------------------------------------------------------------------


def _mysql(store: Any, clock: Callable[[], datetime]) -> Iterator[Finding]:
    ((flush,),) = _query(store, "SELECT @@innodb_flush_log_at_trx_commit")
    value = str(flush)
    if value == "1":
        yield Finding(
            "innodb_flush_log_at_trx_commit",
            Level.PASS,
            "innodb_flush_log_at_trx_commit = 1: a commit is on disk before it is acknowledged",
            None,
            value,
        )
    else:
        loses = "a server crash" if value == "0" else "a machine crash (not a server crash)"
        yield Finding(
            "innodb_flush_log_at_trx_commit",
            Level.FAIL if value == "0" else Level.WARN,
            f"innodb_flush_log_at_trx_commit = {value}: {loses} loses about the last second of"
            " acknowledged commits (records of work that ran), and retries run it again",
            "SET GLOBAL innodb_flush_log_at_trx_commit = 1, and in my.cnf",
            value,
        )
    schema, name = _split(store.dialect.table)
    columns = _query(
        store,
        "SELECT column_name FROM information_schema.columns WHERE table_name = :name"
        " AND table_schema = COALESCE(:schema, DATABASE())",
        {"name": name, "schema": schema},
    )
    tokens_schema, tokens_name = _split(store.dialect.tokens)
    tokens = _query(
        store,
        "SELECT 1 FROM information_schema.tables WHERE table_name = :name"
        " AND table_schema = COALESCE(:schema, DATABASE()) AND table_type = 'SEQUENCE'",
        {"name": tokens_name, "schema": tokens_schema},
    )
    yield _schema(store, {str(c).lower() for (c,) in columns}, bool(tokens), _MYSQL_COLUMNS)
    offset, half = _timed(
        clock, lambda: _query(store, "SELECT UTC_TIMESTAMP(6)")[0][0].replace(tzinfo=UTC)
    )
    yield _skew("MariaDB", offset, half)


# -- SQLite ----------------------------------------------------------------------------------


def _sqlite(store: Any) -> Iterator[Finding]:
    ((mode,),) = _query(store, "PRAGMA journal_mode")
    if str(mode).lower() == "wal":
        yield Finding("journal_mode", Level.PASS, "the file is in WAL mode", None, "wal")
    else:
        yield Finding(
            "journal_mode",
            Level.WARN,
            f"the file is in {mode} (rollback-journal) mode, not WAL: readers and a duplicate"
            " request wait behind every write, and idempo's synchronous=NORMAL is only"
            " crash-safe in WAL mode (an app's own connection in transactional mode keeps its"
            " own settings)",
            f"sqlite3 {store.path} 'PRAGMA journal_mode=WAL' with no other connection open"
            " (idempo's store also switches it when it opens the file to write)",
            str(mode),
        )
    yield Finding(
        "synchronous",
        Level.PASS,
        "idempo's own connections use synchronous=NORMAL in WAL mode: a commit survives an app"
        " crash; an OS crash or power loss can roll back the last commits (SQLite's WAL"
        " trade-off; use PostgreSQL or MariaDB where that matters)",
        None,
        "normal",
    )
    table = store.dialect.table
    columns = _query(store, f"SELECT name FROM pragma_table_info('{table}')")
    tokens = _query(
        store,
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :name",
        {"name": store.dialect.tokens},
    )
    schema = _schema(store, {str(c) for (c,) in columns}, bool(tokens))
    yield schema
    if schema.level is Level.PASS:
        yield _token_triggers(store)
    yield Finding(
        "clock", Level.PASS, "SQLite decides on this host's clock: there is no other", None, "host"
    )


def _token_triggers(store: Any) -> Finding:
    dialect = store.dialect
    ((count,),) = _query(store, dialect.triggers_sql, dialect.triggers_params)
    if count == len(dialect.triggers):
        return Finding("token_triggers", Level.PASS, "triggers keep the token counter", None, "ok")
    return Finding(
        "token_triggers",
        Level.WARN,
        f"the file predates the triggers that keep the token counter {dialect.tokens}:"
        " every fresh reservation takes a write transaction of its own (slower, and"
        " correct)",
        "run `idempo migrate URL` again: it adds the triggers and changes nothing else",
        "missing",
    )


# -- Redis -----------------------------------------------------------------------------------


def _redis_config(store: Any) -> list[tuple[str, dict[str, str]]]:
    """``CONFIG GET`` of the settings that matter, per node (each primary of a cluster)."""
    import redis  # noqa: PLC0415 - only the Redis checks need it

    names = ("appendonly", "appendfsync", "maxmemory-policy", "maxmemory", "save")
    client = store.client
    nodes: list[tuple[str, Any]] = [("", {})]
    if isinstance(client, redis.cluster.RedisCluster):
        nodes = [(f" on {node.name}", {"target_nodes": node}) for node in client.get_primaries()]  # type: ignore[no-untyped-call]
    found = []
    for where, target in nodes:
        config: dict[str, str] = {}
        for name in names:
            reply = client.config_get(name, **target)
            for key, value in reply.items():
                text_key = key.decode() if isinstance(key, bytes) else str(key)
                config[text_key] = value.decode() if isinstance(value, bytes) else str(value)
        found.append((where, config))
    return found


def _redis(store: Any, clock: Callable[[], datetime]) -> Iterator[Finding]:
    import redis  # noqa: PLC0415 - only the Redis checks need it

    try:
        nodes = _redis_config(store)
    except redis.ResponseError as exc:  # CONFIG renamed or refused (managed services)
        yield Finding(
            "config",
            Level.WARN,
            f"Redis refused CONFIG GET ({exc}), so its persistence and eviction cannot be read",
            "check in the provider's settings: appendonly yes, appendfsync always or everysec,"
            " maxmemory-policy noeviction",
            None,
        )
        nodes = []
    except redis.RedisError as exc:  # unreachable, refused, timed out: as the store says it
        from .stores.redis._errors import translated  # noqa: PLC0415 - as above

        raise translated(exc) from exc
    for where, config in nodes:
        yield from _redis_node(where, config)
    offset, half = _timed(clock, lambda: _redis_time(store))
    yield _skew("Redis", offset, half)
    yield Finding("schema", Level.PASS, "Redis keeps no schema: records are strings", None, "none")


def _redis_time(store: Any) -> datetime:
    reply = store.client.time()
    if isinstance(reply, dict):  # a cluster answers per node
        reply = next(iter(reply.values()))
    seconds, micros = reply
    return datetime.fromtimestamp(int(seconds), UTC) + timedelta(microseconds=int(micros))


def _redis_node(where: str, config: dict[str, str]) -> Iterator[Finding]:
    appendonly = config.get("appendonly", "?")
    if appendonly != "yes":
        snapshots = config.get("save", "")
        since = f" (RDB snapshots: save {snapshots!r})" if snapshots else " (and no RDB snapshots)"
        yield Finding(
            "appendonly",
            Level.FAIL,
            f"appendonly is {appendonly}{where}: a restart forgets every record written since"
            f" the last snapshot{since}, and retries of those keys run again",
            "CONFIG SET appendonly yes, then CONFIG REWRITE (or appendonly yes in redis.conf)",
            appendonly,
        )
    else:
        fsync = config.get("appendfsync", "?")
        if fsync == "always":
            yield Finding(
                "appendfsync",
                Level.PASS,
                f"appendonly yes, appendfsync always{where}: nothing acknowledged is lost",
                None,
                fsync,
            )
        else:
            loses = "the last second" if fsync == "everysec" else "up to about 30 seconds"
            yield Finding(
                "appendfsync",
                Level.WARN if fsync == "everysec" else Level.FAIL,
                f"appendfsync {fsync}{where}: a machine crash loses {loses} of acknowledged"
                " records",
                "CONFIG SET appendfsync always (slower writes), or accept the window",
                fsync,
            )
    policy = config.get("maxmemory-policy", "?")
    limit = config.get("maxmemory", "0")
    if policy == "noeviction":
        yield Finding(
            "maxmemory-policy",
            Level.PASS,
            f"maxmemory-policy noeviction{where}: a full Redis refuses writes (the guard fails"
            " closed) and never drops a record",
            None,
            policy,
        )
        return
    fix = "CONFIG SET maxmemory-policy noeviction, then CONFIG REWRITE"
    if limit in ("0", ""):
        yield Finding(
            "maxmemory-policy",
            Level.WARN,
            f"maxmemory-policy {policy}{where}, with no memory limit yet: once one is set, Redis"
            " evicts records (each has a TTL, so volatile-* policies too) and retries run again",
            fix,
            policy,
        )
        return
    yield Finding(
        "maxmemory-policy",
        Level.FAIL,
        f"maxmemory-policy {policy} with maxmemory {limit}{where}: a full Redis silently"
        " evicts records, and retries of those keys run again",
        fix,
        policy,
    )


def _memory() -> Finding:
    return Finding(
        "durability",
        Level.FAIL,
        "memory:// keeps records in this process only: a restart forgets them, and other"
        " processes never see them",
        "use sqlite:///FILE, postgresql://, mysql:// or redis:// outside tests",
        "memory",
    )


# -- retention -------------------------------------------------------------------------------


def _retention(store: Any, horizon: timedelta | None, retention: timedelta | None) -> Finding:
    observed = None if store is None else _observed_retention(store)
    if retention is not None:
        kept, source = retention, "as given"
    elif observed is not None:
        kept, source = observed, "as the stored records show"
    else:
        kept, source = Policy().ttl, "the default policy's"
    value = str(int(kept.total_seconds()))
    if horizon is None:
        return Finding(
            "retention",
            Level.PASS,
            f"records are kept {_span(kept)} after they settle ({source}); give --horizon to"
            " check it covers the time retries keep coming",
            None,
            value,
        )
    if horizon > kept:
        return Finding(
            "retention",
            Level.FAIL,
            f"records are kept {_span(kept)} ({source}) but retries may come for"
            f" {_span(horizon)}: a retry after {_span(kept)} finds no record and runs the work"
            " again",
            f"Policy(ttl=timedelta(seconds={int(horizon.total_seconds())})) or more (and purge"
            " no earlier)",
            value,
        )
    return Finding(
        "retention",
        Level.PASS,
        f"records are kept {_span(kept)} ({source}), covering the {_span(horizon)} horizon",
        None,
        value,
    )


def _observed_retention(store: Any) -> timedelta | None:
    """The shortest retention the store's settled records were given (expiry minus the
    settle time), from a bounded sample; None without the scan verb or such records."""
    scan = getattr(store, "scan", None)
    if scan is None:
        return None
    spans = [
        record.expires_at - record.updated_at
        for status in (Status.COMPLETED, Status.FAILED)
        for record in scan(status=status, limit=100)
    ]
    positive = [span for span in spans if span > timedelta(0)]
    return min(positive) if positive else None
