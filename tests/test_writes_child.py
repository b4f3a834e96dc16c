"""What the spawned processes of tests/test_writes.py run, and the connection helpers both
sides share: a lean module (no pytest, no hypothesis), so a child starts fast. No tests."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import pymysql

from idempo.stores.mysql import connect_options
from idempo.writes import apply_if_newer


@dataclass(frozen=True)
class Spec:
    """How to reach one test's database: picklable, for spawned processes."""

    kind: str  # sqlite | postgres | mariadb
    where: str  # the file, or the server's URL
    prefix: str  # "" or the schema / database the test's tables live in, with its dot
    database: str = ""


def connect(spec: Spec) -> Any:
    """A new DB-API connection, in a transaction the caller commits."""
    if spec.kind == "sqlite":
        return sqlite3.connect(spec.where, timeout=30)
    if spec.kind == "postgres":
        return psycopg.connect(spec.where)
    return pymysql.connect(**{**connect_options(spec.where), "database": spec.database})


def transient(exc: BaseException) -> bool:
    """A serialization failure, deadlock or busy database: the transaction may be retried."""
    if isinstance(exc, psycopg.Error):
        return (exc.sqlstate or "").startswith("40")
    if isinstance(exc, pymysql.err.OperationalError):
        return exc.args[0] in (1205, 1213)
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)


def in_tx(conn: Any, work: Callable[[], Any]) -> Any:
    """``work()`` in its own transaction, committed; retried from scratch when transient."""
    for _ in range(50):
        try:
            result = work()
        except Exception as exc:
            conn.rollback()
            if not transient(exc):
                raise
            continue
        conn.commit()
        return result
    raise AssertionError("still conflicting after 50 tries")


def deliver(spec: Spec, table: str, deliveries: list[dict[str, Any]], start: Any, out: Any) -> None:
    """A spawned process's deliveries, each in its own transaction; what it applied goes to
    ``out`` (or the error it met)."""
    try:
        conn = connect(spec)
        start.wait(timeout=60)
        applied = [
            (e["k"], e["version"])
            for e in deliveries
            if in_tx(conn, lambda e=e: apply_if_newer(conn, table, e, key="k"))
        ]
        conn.close()
        out.put(("ok", applied))
    except BaseException as exc:
        out.put(("error", repr(exc)))
