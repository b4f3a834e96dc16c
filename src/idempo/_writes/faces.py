"""The connections `idempo.writes` runs on, and how one statement runs on each.

A connection is told by its class's module and name, so no optional driver is imported to
recognise it (as `idempo.stores._sql.binding` does): sqlite3, psycopg (``Connection`` and
``AsyncConnection``), PyMySQL, and SQLAlchemy (``Connection``, ``Session`` and their async
twins). Each face turns a `Query` into calls on the connection through one small generator
(`Steps`) that the sync driver calls and the async one awaits, so no statement logic is
written twice.
"""

from __future__ import annotations

import re
import sqlite3
import sys
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..errors import ConfigurationError
from ..stores._sql.transaction import Call, acall, adrive, call, drive
from .plan import Answer, Dialect, Plan, Query, T, Target, check_name, check_table

_CLIENT_FOUND_ROWS = 2  # MySQL protocol capability flag
_MIN_SQLITE = (3, 35, 0)  # RETURNING

Steps = Generator[Call, Any, Answer]
_PARAM = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


def pyformat(sql: str) -> str:
    """``:name`` placeholders as psycopg's and PyMySQL's ``%(name)s``."""
    return _PARAM.sub(r"%(\1)s", sql.replace("%", "%%"))


def _tuples(rows: Sequence[Any]) -> list[tuple[Any, ...]]:
    # Rows as tuples whatever the connection's row factory (dicts, sqlite3.Row, named tuples).
    return [tuple(row.values()) if isinstance(row, Mapping) else tuple(row) for row in rows]


def _kind(conn: Any) -> tuple[str, str, str] | None:
    """(the driver's top package, the class name it is known by, its module) of ``conn``'s
    class or of the first of its bases that is a driver's (an app's subclass), or None."""
    for cls in type(conn).__mro__:
        top = cls.__module__.partition(".")[0]
        if top in ("psycopg", "pymysql", "sqlalchemy"):
            return top, cls.__name__, cls.__module__
    return None


@dataclass(frozen=True, slots=True)
class Face:
    """One connection, ready to run plans: its dialect, how its names are made into SQL,
    and the steps of one statement on it."""

    conn: Any
    dialect: Dialect
    asynchronous: bool
    steps: Callable[[Any, Query, Target], Steps]
    quote: Callable[[str], str] | None  # SQLAlchemy's preparer; None: checked plain names
    found_rows: bool

    def target(self, table: Any, columns: Sequence[str]) -> Target:
        """``table`` and ``columns`` as SQL text, or `ConfigurationError` before anything
        runs: a SQLAlchemy ``Table`` (its columns must be the table's) on a SQLAlchemy
        connection, a plain name (checked identifiers) on any."""
        if _is_table(table):
            if self.quote is None:
                raise ConfigurationError("a SQLAlchemy Table needs a SQLAlchemy connection")
            if missing := [c for c in columns if c not in table.c]:
                raise ConfigurationError(f"table {table.name!r} has no column {missing!r}")
            return Target(
                name=table.fullname,
                table=self._format_table(table),
                columns={c: self.quote(c) for c in columns},
                dialect=self.dialect,
                found_rows=self.found_rows,
                extra=table,
            )
        name = check_table(table)
        return Target(
            name=name,
            table=name,
            columns={c: check_name(c, "column") for c in columns},
            dialect=self.dialect,
            found_rows=self.found_rows,
        )

    def _format_table(self, table: Any) -> str:
        preparer = _dialect_of(self.conn).identifier_preparer
        return str(preparer.format_table(table))

    def run(self, plan: Plan[T], target: Target) -> T:
        """Run ``plan`` to its result on this (sync) connection."""
        return drive(plan, lambda query: drive(self.steps(self.conn, query, target), call))

    async def arun(self, plan: Plan[T], target: Target) -> T:
        """Run ``plan`` to its result on this (async) connection."""

        async def one(query: Query) -> Answer:
            return await adrive(self.steps(self.conn, query, target), acall)

        return await adrive(plan, one)


def _is_table(table: Any) -> bool:
    return any(
        cls.__name__ == "Table" and cls.__module__.startswith("sqlalchemy.")
        for cls in type(table).__mro__
    )


def face(conn: Any, *, asynchronous: bool) -> Face:
    """The face of ``conn``, or `ConfigurationError` naming the connections taken."""
    if isinstance(conn, sqlite3.Connection) and not asynchronous:
        if sqlite3.sqlite_version_info < _MIN_SQLITE:
            raise ConfigurationError(
                f"idempo.writes needs SQLite 3.35+ (RETURNING), not {sqlite3.sqlite_version}"
            )
        return Face(conn, "sqlite", False, _sqlite_steps, None, False)
    top, name, module = _kind(conn) or ("", "", "")
    if (top, name) == ("psycopg", "AsyncConnection" if asynchronous else "Connection"):
        return Face(conn, "postgresql", asynchronous, _psycopg_steps, None, False)
    if (top, name) == ("pymysql", "Connection") and not asynchronous:
        found = bool(getattr(conn, "client_flag", 0) & _CLIENT_FOUND_ROWS)
        return Face(conn, "mariadb", False, _pymysql_steps, None, found)
    if (
        top == "sqlalchemy"
        and name in _SQLALCHEMY_CONNECTIONS
        and module.startswith("sqlalchemy.ext.asyncio") == asynchronous
    ):
        dialect = _dialect_of(conn)
        ours = _DIALECTS.get(dialect.name)
        if ours is None:
            raise ConfigurationError(
                f"idempo.writes runs on PostgreSQL, SQLite and MariaDB, not {dialect.name}"
            )
        if ours == "sqlite" and (dialect.server_version_info or (0,)) < _MIN_SQLITE:
            raise ConfigurationError("idempo.writes needs SQLite 3.35+ (RETURNING)")
        quote = dialect.identifier_preparer.quote
        found = ours == "mariadb" and _sqlalchemy_found_rows(conn)
        return Face(conn, ours, asynchronous, _sqlalchemy_steps, quote, found)
    face_name = "async" if asynchronous else "sync"
    raise ConfigurationError(
        f"the {face_name} idempo.writes helpers cannot run on a"
        f" {type(conn).__module__}.{type(conn).__qualname__}: they take {_takes(asynchronous)}"
    )


def _takes(asynchronous: bool) -> str:
    if asynchronous:
        return "a psycopg AsyncConnection, or a SQLAlchemy AsyncConnection or AsyncSession"
    return (
        "a sqlite3.Connection, a psycopg Connection, a PyMySQL Connection, or a SQLAlchemy"
        " Connection or Session"
    )


# What runs statements in a transaction; an Engine does not (it hands out connections).
_SQLALCHEMY_CONNECTIONS = frozenset(
    {"Connection", "Session", "scoped_session", "AsyncConnection", "AsyncSession"}
)
_DIALECTS: dict[str, Dialect] = {
    "postgresql": "postgresql",
    "sqlite": "sqlite",
    "mysql": "mariadb",
    "mariadb": "mariadb",
}


def _sqlalchemy_found_rows(conn: Any) -> bool:
    """Whether the DB-API connection under a SQLAlchemy one counts found rows: SQLAlchemy's
    MySQL dialects set CLIENT_FOUND_ROWS unless ``connect_args={"client_flag": ...}`` says
    otherwise. Assumed set when the driver does not show its flags."""
    conn = getattr(conn, "sync_session", None) or getattr(conn, "sync_connection", None) or conn
    if not hasattr(conn, "dialect"):  # a Session: the connection it runs its statements on
        conn = conn.connection()
    dbapi = conn.connection.dbapi_connection
    flags = getattr(dbapi, "client_flag", None)
    if flags is None:  # SQLAlchemy's adapter around an async driver's connection
        flags = getattr(getattr(dbapi, "_connection", None), "client_flag", None)
    return flags is None or bool(flags & _CLIENT_FOUND_ROWS)


def _dialect_of(conn: Any) -> Any:
    """The SQLAlchemy dialect behind a Connection, a Session or their async twins."""
    conn = getattr(conn, "sync_session", None) or getattr(conn, "sync_connection", None) or conn
    dialect = getattr(conn, "dialect", None)
    return dialect if dialect is not None else conn.get_bind().dialect


# -- one statement on each kind of connection ---------------------------------------------


def _sqlite_steps(conn: Any, query: Query, target: Target) -> Steps:
    cursor = yield conn.execute, (query.sql, query.params)
    try:
        rows = cursor.fetchall() if cursor.description is not None else []
        return Answer(_tuples(rows), cursor.rowcount)
    finally:
        cursor.close()


def _psycopg_steps(conn: Any, query: Query, target: Target) -> Steps:
    # The same calls on a sync connection and, awaited, on an async one.
    cursor = yield conn.execute, (pyformat(query.sql), query.params)
    rows = (yield cursor.fetchall, ()) if cursor.description is not None else []
    return Answer(_tuples(rows), cursor.rowcount)


def _pymysql_steps(conn: Any, query: Query, target: Target) -> Steps:
    cursor = yield conn.cursor, ()
    try:
        count = yield cursor.execute, (pyformat(query.sql), query.params)
        rows = (yield cursor.fetchall, ()) if cursor.description else []
        return Answer(_tuples(rows), count)
    finally:
        cursor.close()


def _sqlalchemy_steps(conn: Any, query: Query, target: Target) -> Steps:
    # Async sessions and connections hand back a buffered result: read it without awaiting.
    result = yield conn.execute, (_clause(query, target), query.params)
    rows = list(result) if result.returns_rows else []
    return Answer(_tuples(rows), result.rowcount)


def _clause(query: Query, target: Target) -> Any:
    """``query`` as a SQLAlchemy text clause; on a ``Table``, typed by its columns both ways
    (a JSON or DateTime column gets its value through its type, as SQLAlchemy would)."""
    sqlalchemy = sys.modules["sqlalchemy"]  # loaded: the connection is SQLAlchemy's
    clause = _text(query.sql)
    table = target.extra
    if table is None:
        return clause
    used = set(_PARAM.findall(query.sql))  # a plan's later statements reuse fewer values
    clause = clause.bindparams(
        *(
            sqlalchemy.bindparam(name, type_=table.c[col].type)
            for name, col in query.binds.items()
            if name in used
        )
    )
    if query.returns:
        clause = clause.columns(*(table.c[col] for col in query.returns))
    return clause


@lru_cache(maxsize=256)
def _text(sql: str) -> Any:
    return sys.modules["sqlalchemy"].text(sql)
