"""Transactional mode for the sync middlewares: Flask (WSGI, ``connection=``) and Django
(``IDEMPO["CONNECTION"]``, Django's own ``transaction.atomic``), with the view writing on the
connection that carries its idempotency record.

Real SQLite files and the real PostgreSQL (each test in its own file or schema); SQLAlchemy's
``engine.connect`` and ``sessionmaker`` and a psycopg ``ConnectionPool`` for Flask. What is
committed is always read through a separate, plain driver connection (`AppDatabase`), and
the business table has no unique constraint, so a second execution would show as a second
row. The crash cases check that the write and the record commit together or not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any
from urllib.parse import urlsplit

import pytest

import django_setup  # noqa: F401 - configures Django before its modules are imported

# isort: split
from django.conf import settings as django_settings
from django.db import connection as django_connection
from django.db import connections
from django.http import HttpRequest, HttpResponse
from django.test import Client, override_settings
from django.urls import path
from flask import Flask, request
from psycopg_pool import ConnectionPool
from sqlalchemy import Connection as SqlAlchemyConnection
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session, sessionmaker

from helpers import new_key
from idempo import ConfigurationError, Scope
from idempo.stores.memory import MemoryStore
from idempo.wsgi import IdempotencyWSGIMiddleware, current_attempt, idempotent_connection
from test_sqlalchemy import AppDatabase

DATABASES = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
]
FACTORIES = ["connect", "session", "pool"]


class Crash(BaseException):
    """A crash between the view's write and the commit (not an Exception: nothing in the
    framework catches it, as nothing catches a process dying)."""


@pytest.fixture(params=DATABASES)
def database(request: pytest.FixtureRequest) -> AppDatabase:
    """The case's database, with an empty business table and a migrated records table."""
    found = AppDatabase(**asdict(request.getfixturevalue(f"{request.param}_database")))
    found.create_business_table("idem_key TEXT NOT NULL, worker TEXT NOT NULL")
    return found


# --- Flask ----------------------------------------------------------------------------------


def _factory(database: AppDatabase, kind: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    """A connection factory of ``kind`` on ``database``, and what closes it."""
    if kind == "pool":
        if database.kind != "postgres":
            pytest.skip("a psycopg pool is PostgreSQL's")
        pool = ConnectionPool(database.location, min_size=1, max_size=4, open=True)
        return pool.connection, pool.close
    engine = create_engine(database.url(asynchronous=False))
    if kind == "session":
        return sessionmaker(engine), engine.dispose
    return engine.connect, engine.dispose


def _write(conn: Any, database: AppDatabase, key: str) -> None:
    if isinstance(conn, Session | SqlAlchemyConnection):
        conn.execute(text(database.insert), {"key": key, "worker": "flask"})
        return
    sql = database.insert.replace(":key", "%(key)s").replace(":worker", "%(worker)s")
    conn.execute(sql, {"key": key, "worker": "flask"})


@contextmanager
def flask_client(database: AppDatabase, kind: str, mode: str = "transactional") -> Iterator[Any]:
    factory, close = _factory(database, kind)
    store = database.store()
    app = Flask(__name__)
    seen: list[Any] = []

    @app.post("/work")
    def work() -> Any:
        key = request.headers["Idempotency-Key"]
        _write(idempotent_connection(request.environ), database, key)
        assert current_attempt(request.environ).scope.key == key
        seen.append((database.rows(), database.records_seen()))  # in flight: nothing shows
        if request.headers.get("X-Crash") == "exception":
            raise RuntimeError("the view failed after its write")
        if request.headers.get("X-Crash") == "process":
            raise Crash
        if request.headers.get("X-Status"):
            return {"refused": True}, int(request.headers["X-Status"])
        return {"ok": True}, 201

    app.wsgi_app = IdempotencyWSGIMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, store=store, connection=factory, mode=mode
    )
    try:
        with app.test_client() as client:
            client.seen = seen  # type: ignore[attr-defined]
            yield client
    finally:
        close()
        store.close()


@pytest.mark.parametrize("kind", FACTORIES)
def test_flask_the_write_commits_with_the_stored_response(database: AppDatabase, kind: str) -> None:
    key = new_key()
    with flask_client(database, kind) as client:
        first = client.post("/work", headers={"Idempotency-Key": key})
        again = client.post("/work", headers={"Idempotency-Key": key})
        assert client.seen == [([], [])]  # while the view ran, neither write had committed
    assert first.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.data == first.data
    assert database.rows() == [(key, "flask")]
    assert [(row[0], row[1]) for row in database.records_seen()] == [(key, "completed")]


@pytest.mark.parametrize("crash", ["exception", "process"])
def test_flask_a_crash_keeps_neither_the_write_nor_the_record(
    database: AppDatabase, crash: str
) -> None:
    key = new_key()
    with flask_client(database, "connect") as client:
        if crash == "process":
            with pytest.raises(Crash):
                client.post("/work", headers={"Idempotency-Key": key, "X-Crash": crash})
        else:
            assert (
                client.post("/work", headers={"Idempotency-Key": key, "X-Crash": crash}).status_code
                == 500
            )
        assert database.rows() == []
        assert database.records_seen() == []
        retry = client.post("/work", headers={"Idempotency-Key": key})  # the key is free
    assert retry.status_code == 201
    assert database.rows() == [(key, "flask")]


def test_flask_a_deterministic_4xx_commits_its_writes_with_the_failure(
    database: AppDatabase,
) -> None:
    """As over ASGI: a 4xx answer is the request's outcome, recorded FAILED and replayed, and
    what the view wrote commits with it."""
    key = new_key()
    with flask_client(database, "connect") as client:
        first = client.post("/work", headers={"Idempotency-Key": key, "X-Status": "422"})
        again = client.post("/work", headers={"Idempotency-Key": key})
    assert (first.status_code, again.status_code) == (422, 422)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert database.rows() == [(key, "flask")]
    assert [row[1] for row in database.records_seen()] == ["failed"]


def test_flask_leased_mode_commits_the_write_with_the_fenced_response(
    database: AppDatabase,
) -> None:
    key = new_key()
    with flask_client(database, "connect", mode="leased") as client:
        first = client.post("/work", headers={"Idempotency-Key": key})
        again = client.post("/work", headers={"Idempotency-Key": key})
        ((rows, records),) = client.seen
    assert rows == []
    assert [record[1] for record in records] == ["in_progress"]  # the lease committed first
    assert (first.status_code, again.headers["Idempotent-Replayed"]) == (201, "true")
    assert database.rows() == [(key, "flask")]


def test_flask_connection_needs_a_sql_store() -> None:
    with pytest.raises(ConfigurationError, match="cannot join"):
        IdempotencyWSGIMiddleware(lambda e, s: [], store=MemoryStore(), connection=lambda: None)


# --- Django ---------------------------------------------------------------------------------


def django_work(request: HttpRequest) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    with django_connection.cursor() as cursor:
        cursor.execute(str(request.META["idempo.test.insert"]), [key, "django"])
    seen.append((database_of(request).rows(), database_of(request).records_seen()))
    crash = request.headers.get("X-Crash")
    if crash == "exception":
        raise RuntimeError("the view failed after its write")
    if crash == "process":
        raise Crash
    return HttpResponse(b'{"ok": true}', status=201, content_type="application/json")


seen: list[Any] = []
urlpatterns = [path("work", django_work)]


def database_of(request: HttpRequest) -> AppDatabase:
    found: AppDatabase = request.META["idempo.test.database"]
    return found


@contextmanager
def django_client(database: AppDatabase) -> Iterator[Client]:
    """A Django test client whose default database is ``database`` and whose middleware
    carries the record on it (``CONNECTION: "default"``)."""
    if database.kind == "sqlite":
        entry = {"ENGINE": "django.db.backends.sqlite3", "NAME": database.location}
    else:
        url = urlsplit(database.location)
        entry = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": url.path.lstrip("/"),
            "USER": url.username or "",
            "PASSWORD": url.password or "",
            "HOST": url.hostname or "",
            "PORT": str(url.port or ""),
        }
    store = database.store()
    insert = database.insert.replace(":key", "%s").replace(":worker", "%s")
    seen.clear()
    with (
        _default_database(entry),
        override_settings(ROOT_URLCONF=__name__, IDEMPO={"STORE": store, "CONNECTION": "default"}),
    ):
        client = Client(raise_request_exception=True)
        client.defaults["idempo.test.insert"] = insert
        client.defaults["idempo.test.database"] = database
        try:
            yield client
        finally:
            store.close()


@contextmanager
def _default_database(entry: dict[str, Any]) -> Iterator[None]:
    """Django's ``default`` database replaced by ``entry`` for a while."""
    old_settings = dict(django_settings.DATABASES["default"])
    connections["default"].close()
    configured = connections.configure_settings({"default": entry})
    django_settings.DATABASES["default"] = configured["default"]
    connections.settings["default"] = configured["default"]
    del connections["default"]
    try:
        yield
    finally:
        connections["default"].close()
        django_settings.DATABASES["default"] = old_settings
        connections.settings["default"] = old_settings
        del connections["default"]


def test_django_the_write_commits_with_the_stored_response(database: AppDatabase) -> None:
    key = new_key()
    with django_client(database) as client:
        first = client.post("/work", headers={"Idempotency-Key": key})
        again = client.post("/work", headers={"Idempotency-Key": key})
    assert seen == [([], [])]  # while the view ran, neither write had committed
    assert first.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert database.rows() == [(key, "django")]
    assert [(row[0], row[1]) for row in database.records_seen()] == [(key, "completed")]


@pytest.mark.parametrize("crash", ["exception", "process"])
def test_django_a_crash_keeps_neither_the_write_nor_the_record(
    database: AppDatabase, crash: str
) -> None:
    key = new_key()
    with django_client(database) as client:
        client.raise_request_exception = False
        if crash == "process":
            with pytest.raises(Crash):
                client.post("/work", headers={"Idempotency-Key": key, "X-Crash": crash})
        else:
            assert (
                client.post("/work", headers={"Idempotency-Key": key, "X-Crash": crash}).status_code
                == 500
            )
        assert database.rows() == []
        assert database.records_seen() == []
        retry = client.post("/work", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert database.rows() == [(key, "django")]
    store = database.store()
    try:
        assert store.get(Scope("", "POST work", key)) is not None
    finally:
        # Left to the garbage collector, the store's pool may be collected on its own worker
        # thread, whose join then raises in whichever test runs at the time.
        store.close()


def test_flask_a_database_error_at_commit_is_503_and_keeps_nothing(
    database: AppDatabase,
) -> None:
    """An error only the commit raises (a pending ORM object that breaks a unique index when
    the guard's commit flushes it) rolls back the write and the record together: 503
    ``not-committed``, not the 201 the view built, and the key is free again."""
    from test_asgi_connection import Payment

    database.execute(f"CREATE UNIQUE INDEX one_per_worker ON {database.business_table} (worker)")
    database.execute(f"INSERT INTO {database.business_table} VALUES ('other', 'taken')")
    schema = database.schema
    engine = create_engine(database.url(asynchronous=False)).execution_options(
        schema_translate_map={None: schema} if schema else None
    )
    store = database.store()
    app = Flask(__name__)

    @app.post("/pay")
    def pay() -> Any:
        session = idempotent_connection(request.environ)
        session.add(Payment(idem_key=request.headers["Idempotency-Key"], worker="taken"))
        return {"paid": True}, 201  # no flush: the commit fails

    app.wsgi_app = IdempotencyWSGIMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, store=store, connection=sessionmaker(engine)
    )
    try:
        answer = app.test_client().post("/pay", headers={"Idempotency-Key": new_key()})
    finally:
        engine.dispose()
        store.close()
    assert answer.status_code == 503
    assert answer.json["type"] == "urn:idempo:problem:not-committed"  # type: ignore[index]
    assert database.records_seen() == []
    assert database.rows() == [("other", "taken")]
