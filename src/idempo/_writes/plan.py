"""The SQL of `idempo.writes`, written once: each helper is a generator that yields `Query`s
and receives `Answer`s, so every connection (sqlite3, psycopg, PyMySQL, SQLAlchemy; sync or
async) runs the same statements and makes the same decisions. Faces only execute.

Names reach SQL only as a `Target`: identifiers checked here (DB-API) or quoted by
SQLAlchemy's own preparer (a ``Table``). Values are always parameters.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar

from ..errors import ConfigurationError, VersionConflictError

T = TypeVar("T")
Dialect = Literal["postgresql", "sqlite", "mariadb"]

# A plain identifier: what these helpers accept as a DB-API table or column name, and so
# may put into SQL as it is. 63 characters: PostgreSQL cuts longer names silently.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
# MariaDB's "Duplicate entry ... for key": its InnoDB rolls back the failed INSERT alone,
# so the transaction goes on.
_ER_DUP_ENTRY = 1062


class Query(NamedTuple):
    """One statement with ``:name`` parameters. ``binds`` maps a parameter to the column whose
    value it carries, ``returns`` names the table columns the statement returns, in order
    (SQLAlchemy uses both for the columns' types)."""

    sql: str
    params: dict[str, Any]
    binds: dict[str, str]
    returns: tuple[str, ...] = ()


class Answer(NamedTuple):
    """What a statement gave back: its rows as tuples, and the driver's row count."""

    rows: list[tuple[Any, ...]]
    rowcount: int


Plan = Generator[Query, Answer, T]


@dataclass(frozen=True, slots=True)
class Target:
    """A table and its columns as SQL text, ready to interpolate. ``found_rows``: the
    connection counts the rows an update *found*, not the rows it changed (MariaDB's
    CLIENT_FOUND_ROWS, which SQLAlchemy always sets)."""

    name: str  # as the caller named it, for messages
    table: str
    columns: Mapping[str, str]
    dialect: Dialect
    found_rows: bool = False
    extra: Any = field(default=None, compare=False)  # the face's own (SQLAlchemy: the Table)

    def col(self, name: str) -> str:
        return self.columns[name]


def check_name(name: object, what: str) -> str:
    """``name`` when it is a plain identifier; `ConfigurationError` otherwise, before any
    SQL is made: names are interpolated, so nothing else may pass."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"{what} {name!r} is not a plain identifier (letters, digits and _, at most 63,"
            " not starting with a digit)"
        )
    return name


def check_table(name: object) -> str:
    """A DB-API table name: an identifier, optionally qualified by one schema."""
    if not isinstance(name, str):
        raise ConfigurationError(f"table {name!r} is not a table name")
    for part in name.split(".", 1):
        check_name(part, "table name part")
    return name


def names(value: object, what: str) -> tuple[str, ...]:
    """A column or a sequence of columns as a tuple of names (not yet checked)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise ConfigurationError(f"{what} must be a column name or a sequence of them, not {value!r}")


def mapping(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigurationError(f"{what} must be a mapping of column names to values")
    return dict(value)


def _unique(cols: Sequence[str], what: str) -> None:
    if len(set(cols)) != len(cols):
        raise ConfigurationError(f"{what} names a column twice: {list(cols)!r}")


# -- what every helper's SQL is made of --------------------------------------------------


class _Params:
    """Parameters named by position (``v0``, ``v1``...): column names never become
    parameter names, so a quoted SQLAlchemy column can carry any name."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.binds: dict[str, str] = {}
        self._by_column: dict[str, str] = {}

    def of(self, column: str, value: Any) -> str:
        """The placeholder of ``column``'s value (one per column)."""
        if column not in self._by_column:
            name = f"v{len(self._by_column)}"
            self._by_column[column] = name
            self.params[name] = value
            self.binds[name] = column
        return ":" + self._by_column[column]

    def query(self, sql: str, returns: Sequence[str] = ()) -> Query:
        return Query(sql, dict(self.params), dict(self.binds), tuple(returns))


def _where(t: Target, p: _Params, key: Mapping[str, Any]) -> str:
    return " AND ".join(f"{t.col(c)} = {p.of(c, v)}" for c, v in key.items())


def _insert(t: Target, p: _Params, values: Mapping[str, Any]) -> str:
    cols = ", ".join(t.col(c) for c in values)
    marks = ", ".join(p.of(c, v) for c, v in values.items())
    return f"({cols}) VALUES ({marks})"


def _select(t: Target, p: _Params, cols: Sequence[str], key: Mapping[str, Any], lock: str) -> Query:
    listed = ", ".join(t.col(c) for c in cols)
    return p.query(f"SELECT {listed} FROM {t.table} WHERE {_where(t, p, key)}{lock}", cols)


def is_duplicate(exc: BaseException) -> bool:
    """``exc`` (or, through SQLAlchemy, its ``orig``) is MariaDB's duplicate-key error."""
    orig = getattr(exc, "orig", None) or exc
    args: tuple[Any, ...] = getattr(orig, "args", ())
    return bool(args) and args[0] == _ER_DUP_ENTRY


@dataclass(frozen=True, slots=True)
class CreateOnce:
    values: dict[str, Any]
    key: tuple[str, ...]
    update: tuple[str, ...]
    returning: tuple[str, ...]

    @classmethod
    def checked(
        cls, values: object, key: object, update: object, returning: object | None
    ) -> CreateOnce:
        row = mapping(values, "values")
        keys = names(key, "key")
        updates = names(update, "update") if update else ()
        returned = tuple(row) if returning is None else names(returning, "returning")
        for cols, what in ((keys, "key"), (updates, "update"), (returned, "returning")):
            _unique(cols, what)
        if not keys:
            raise ConfigurationError("key names no column: a create-once needs a natural key")
        if not returned:
            raise ConfigurationError("returning names no column")
        if missing := [c for c in (*keys, *updates) if c not in row]:
            raise ConfigurationError(f"values has no value for {missing!r}")
        if both := [c for c in updates if c in keys]:
            raise ConfigurationError(f"update names key columns {both!r}: a key never changes")
        return cls(row, keys, updates, returned)

    def columns(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.values, *self.returning)))


def create_once(t: Target, op: CreateOnce) -> Plan[tuple[dict[str, Any], bool]]:
    """The row named by ``op.key`` and whether this call created it.

    PostgreSQL and SQLite: ``INSERT ... ON CONFLICT (key) DO NOTHING RETURNING`` says
    exactly whether it inserted; when it did not, the existing row is read (or updated, for
    ``op.update``). On PostgreSQL that insert waits for a concurrent inserter of the same key
    to finish, so under READ COMMITTED the read that follows sees its row (REPEATABLE READ
    and SERIALIZABLE raise a serialization failure instead, as they should).

    MariaDB: see `_mariadb_create`.
    """
    if t.dialect == "mariadb":
        return (yield from _mariadb_create(t, op))
    key = {c: op.values[c] for c in op.key}
    returned = ", ".join(t.col(c) for c in op.returning)
    conflict = ", ".join(t.col(c) for c in op.key)
    for _ in range(3):  # a row deleted between the two statements: try again
        p = _Params()
        inserted = yield p.query(
            f"INSERT INTO {t.table} {_insert(t, p, op.values)}"
            f" ON CONFLICT ({conflict}) DO NOTHING RETURNING {returned}",
            op.returning,
        )
        if inserted.rows:
            return _row(op.returning, inserted.rows[0]), True
        if op.update:
            sets = ", ".join(f"{t.col(c)} = {p.of(c, op.values[c])}" for c in op.update)
            found = yield p.query(
                f"UPDATE {t.table} SET {sets} WHERE {_where(t, p, key)} RETURNING {returned}",
                op.returning,
            )
        else:
            found = yield _select(t, p, op.returning, key, "")
        if found.rows:
            return _row(op.returning, found.rows[0]), False
    raise ConfigurationError(f"{t.name}: the row of {key!r} keeps disappearing under create_once")


def _mariadb_create(t: Target, op: CreateOnce) -> Plan[tuple[dict[str, Any], bool]]:
    """MariaDB has no ``ON CONFLICT`` and cannot say, in a way every connection reads alike,
    whether ``ON DUPLICATE KEY UPDATE`` inserted; and a plain follow-up SELECT under its
    default REPEATABLE READ reads the transaction's snapshot, which may predate the row just
    collided with. So:

    - create-once: a plain INSERT. MariaDB's duplicate-key error rolls back that statement
      alone; the row is then read with ``LOCK IN SHARE MODE``, a locking read, which sees
      the latest committed row whatever the snapshot. Concurrent duplicates all hold the same
      shared lock: none waits for another, none deadlocks. A duplicate on *another* unique
      key finds no row of ours and raises as the INSERT did.
    - with ``update``: ``INSERT ... ON DUPLICATE KEY UPDATE`` (it takes the row's exclusive
      lock at once, so concurrent upserts queue rather than deadlock), then ``SELECT ...
      FOR UPDATE``, which reads the row it locked. Whether it inserted is its affected-row
      count: 1 inserted, 2 updated, 0 found unchanged; except that a connection with
      CLIENT_FOUND_ROWS also counts "found unchanged" as 1, so there an existing row whose
      values were already these reads as created.
    """
    key = {c: op.values[c] for c in op.key}
    p = _Params()
    insert = f"INSERT INTO {t.table} {_insert(t, p, op.values)}"
    if not op.update:
        try:
            yield p.query(insert)
        except Exception as exc:
            if not is_duplicate(exc):
                raise
            found = yield _select(t, p, op.returning, key, " LOCK IN SHARE MODE")
            if not found.rows:
                raise  # a duplicate on another unique key: the caller's error to see
            return _row(op.returning, found.rows[0]), False
        found = yield _select(t, p, op.returning, key, "")
        return _row(op.returning, found.rows[0]), True
    sets = ", ".join(f"{t.col(c)} = VALUES({t.col(c)})" for c in op.update)
    written = yield p.query(f"{insert} ON DUPLICATE KEY UPDATE {sets}")
    found = yield _select(t, p, op.returning, key, " FOR UPDATE")
    if not found.rows:
        raise ConfigurationError(
            f"{t.name}: ON DUPLICATE KEY UPDATE hit another unique key than {list(op.key)!r};"
            " on MariaDB the natural key must be the table's only unique key"
        )
    return _row(op.returning, found.rows[0]), written.rowcount == 1


@dataclass(frozen=True, slots=True)
class VersionUpdate:
    key: dict[str, Any]
    values: dict[str, Any]
    expected: int
    version: str

    @classmethod
    def checked(
        cls, key: object, values: object, expected: object, version: object
    ) -> VersionUpdate:
        keys = mapping(key, "key")
        row = mapping(values, "values")
        if not keys:
            raise ConfigurationError("key names no column: the version guard needs the row's key")
        if not isinstance(version, str):
            raise ConfigurationError(f"version must be a column name, not {version!r}")
        if isinstance(expected, bool) or not isinstance(expected, int):
            raise ConfigurationError(f"expected must be an int version, not {expected!r}")
        if clash := [c for c in row if c in keys or c == version]:
            raise ConfigurationError(
                f"values sets {clash!r}: the key never changes and the guard moves the version"
            )
        if version in keys:
            raise ConfigurationError(f"the version column {version!r} cannot be part of the key")
        return cls(keys, row, expected, version)

    def columns(self) -> tuple[str, ...]:
        return (*self.key, *self.values, self.version)


def update_if_version(t: Target, op: VersionUpdate) -> Plan[int]:
    """``UPDATE ... SET ..., version = version + 1 WHERE key AND version = :expected``: the
    new version, or `VersionConflictError` when no row matched (nothing changed then).

    The count is the rows the update matched on PostgreSQL and SQLite and the rows it changed
    on MariaDB: the same here, as the version itself always changes."""
    p = _Params()
    ver = t.col(op.version)
    sets = "".join(f"{t.col(c)} = {p.of(c, v)}, " for c, v in op.values.items())
    where = _where(t, p, op.key)
    p.params["expected"] = op.expected
    p.binds["expected"] = op.version
    done = yield p.query(
        f"UPDATE {t.table} SET {sets}{ver} = {ver} + 1 WHERE {where} AND {ver} = :expected"
    )
    if done.rowcount == 1:
        return op.expected + 1
    if done.rowcount > 1:
        raise ConfigurationError(
            f"{t.name}: key {op.key!r} matched {done.rowcount} rows; it must name one row"
            " (roll the transaction back: they were all updated)"
        )
    # The version that beat this one. MariaDB's plain SELECT would read the transaction's
    # snapshot (REPEATABLE READ), maybe the very version just refused: read it locked.
    lock = " LOCK IN SHARE MODE" if t.dialect == "mariadb" else ""
    found = yield _select(t, p, (op.version,), op.key, lock)
    actual = found.rows[0][0] if found.rows else None
    raise VersionConflictError(t.name, op.key, op.expected, actual)


@dataclass(frozen=True, slots=True)
class ApplyIfNewer:
    values: dict[str, Any]
    key: tuple[str, ...]
    version: str

    @classmethod
    def checked(cls, values: object, key: object, version: object) -> ApplyIfNewer:
        row = mapping(values, "values")
        keys = names(key, "key")
        _unique(keys, "key")
        if not keys:
            raise ConfigurationError("key names no column: last-writer-wins needs the row's key")
        if not isinstance(version, str):
            raise ConfigurationError(f"version must be a column name, not {version!r}")
        if version in keys:
            raise ConfigurationError(f"the version column {version!r} cannot be part of the key")
        if missing := [c for c in (*keys, version) if c not in row]:
            raise ConfigurationError(f"values has no value for {missing!r}")
        if row[version] is None:
            raise ConfigurationError("the event's version is None: it could never be newer")
        return cls(row, keys, version)

    def columns(self) -> tuple[str, ...]:
        return tuple(self.values)


def apply_if_newer(t: Target, op: ApplyIfNewer) -> Plan[bool]:
    """Insert the row, or overwrite it only when the event's version is greater than the
    stored one; in one statement, so the database decides under the row's lock. True when
    this call wrote (inserted or overwrote).

    PostgreSQL and SQLite: an upsert whose update has a WHERE; RETURNING yields a row only
    when it wrote. MariaDB: ``ON DUPLICATE KEY UPDATE`` has no WHERE, so every column is
    ``IF(VALUES(version) > version, VALUES(col), col)`` and the version column comes last:
    MariaDB assigns left to right and later expressions read the columns already assigned, so
    a version assigned first would make every later comparison false. Whether it wrote is
    its affected-row count (1 inserted, 2 overwrote, 0 kept); with CLIENT_FOUND_ROWS a kept
    row counts 1 too, and the stored version then tells the two apart (see `_found_rows`).
    """
    p = _Params()
    ver = t.col(op.version)
    others = [c for c in op.values if c not in op.key and c != op.version]
    insert = f"INSERT INTO {t.table} {{alias}}{_insert(t, p, op.values)}"
    if t.dialect == "mariadb":
        newer = f"VALUES({ver}) > {ver}"
        sets = ", ".join(
            f"{t.col(c)} = IF({newer}, VALUES({t.col(c)}), {t.col(c)})"
            for c in [*others, op.version]
        )
        done = yield p.query(f"{insert.format(alias='')} ON DUPLICATE KEY UPDATE {sets}")
        if done.rowcount != 1 or not t.found_rows:
            return done.rowcount in (1, 2)
        return (yield from _found_rows(t, p, op))
    conflict = ", ".join(t.col(c) for c in op.key)
    sets = ", ".join(f"{t.col(c)} = excluded.{t.col(c)}" for c in [*others, op.version])
    done = yield p.query(
        f"{insert.format(alias='AS idempo_t ')} ON CONFLICT ({conflict}) DO UPDATE SET {sets}"
        f" WHERE idempo_t.{ver} < excluded.{ver} RETURNING {ver}",
        (op.version,),
    )
    return bool(done.rows)


def _found_rows(t: Target, p: _Params, op: ApplyIfNewer) -> Plan[bool]:
    """Through CLIENT_FOUND_ROWS, a count of 1 is "inserted" or "kept". The row is locked by
    now, so its version says which: another version means kept. The one case it cannot tell
    is a duplicate of the event the row holds: reported as written. The table is right
    either way (the row holds that event); only the flag is loose."""
    key = {c: op.values[c] for c in op.key}
    found = yield _select(t, p, (op.version,), key, " FOR UPDATE")
    return bool(found.rows) and found.rows[0][0] == op.values[op.version]


def _row(columns: Sequence[str], values: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(columns, values, strict=True))
