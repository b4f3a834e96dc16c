"""The relay's own database connection: opened from a store URL (or an async SQL store),
with the drivers and executors the stores use, and reopened after it fails.

PostgreSQL and MariaDB: one connection of the relay's own; a batch is one transaction on
it, and the relay's `Publish` operation runs inside it, between the claim and the marks.
SQLite: the async store itself, whose every run is one ``BEGIN IMMEDIATE`` transaction in a
worker thread (SQLite's claims are leases, so nothing is published inside one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

from ..errors import ConfigurationError, StoreError, StoreUnavailableError
from ..stores import open_async_store
from ..stores._sql.transaction import Begin, Commit, Rollback, adrive
from ._sql import Publish, RelayGen

__all__ = ["RelayDb", "open_db"]

T = TypeVar("T")

PublishFn = Callable[[Publish], Awaitable[Any]]


def _transaction(gen: RelayGen[T]) -> Generator[Any, Any, T]:
    """``gen`` inside one transaction: committed if it returns, rolled back if it raises."""
    yield Begin(reserves=False)
    try:
        result = yield from gen
    except BaseException:
        yield Rollback()
        raise
    yield Commit()
    return result


class RelayDb:
    """What the relay runs its statements on. ``name``: the database (``postgresql``,
    ``sqlite``, ``mysql``); ``table``: the records table of the store it came from."""

    name: str
    table: str

    async def run(self, gen: RelayGen[T], publish: PublishFn) -> T:
        """Run ``gen`` as one transaction; its `Publish` operations go to ``publish``."""
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class _StoreDb(RelayDb):
    """SQLite: each run is one of the async store's write transactions."""

    def __init__(self, store: Any, *, owned: bool) -> None:
        self._store = store
        self._owned = owned
        self.name = "sqlite"
        self.table = store.dialect.table

    async def run(self, gen: RelayGen[T], publish: PublishFn) -> T:
        # SQLite's batches publish between two runs, never inside one (see OutboxSql.claim).
        result: T = await self._store.run(gen)
        return result

    async def aclose(self) -> None:
        if self._owned:
            await self._store.aclose()


class _ServerDb(RelayDb):
    """PostgreSQL or MariaDB: one connection of the relay's own, opened on first use and
    again after a failure. Every database call is bounded by ``timeout``: a server that
    stops answering fails the batch (its transaction dies with the connection)."""

    def __init__(
        self,
        name: str,
        store: Any,
        connect: Callable[[], Awaitable[tuple[Any, Any]]],
        close: Callable[[Any], Awaitable[None]],
        *,
        owned: bool,
        timeout: float,
    ) -> None:
        self.name = name
        self.table = store.dialect.table
        self._store = store
        self._owned = owned
        self._connect = connect
        self._close = close
        self._timeout = timeout
        self._conn: Any = None
        self._executor: Any = None

    async def run(self, gen: RelayGen[T], publish: PublishFn) -> T:
        if self._conn is None:
            self._conn, self._executor = await self._connect()
        executor = self._executor

        async def do(op: Any) -> Any:
            if isinstance(op, Publish):
                return await publish(op)
            try:
                async with asyncio.timeout(self._timeout):
                    return await executor.do(op)
            except TimeoutError as exc:
                raise StoreUnavailableError(
                    f"the {self.name} server did not answer within {self._timeout:g} s"
                ) from exc

        try:
            return await adrive(_transaction(gen), do, executor.error)
        except BaseException as exc:
            # A failed batch may leave the connection in any state (a broken socket, a
            # transaction the rollback could not end, a cancellation mid-statement): a
            # fresh one next time. Closing it ends whatever transaction it held.
            if not isinstance(exc, StoreError) or isinstance(exc, StoreUnavailableError):
                await self._drop()
            raise

    async def _drop(self) -> None:
        conn, self._conn, self._executor = self._conn, None, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await self._close(conn)

    async def aclose(self) -> None:
        await self._drop()
        if self._owned:
            await self._store.aclose()


async def open_db(store: Any, *, answer_within: float = 30.0) -> RelayDb:
    """The relay's database for ``store``: a store URL (``postgresql://``, ``sqlite:///``,
    ``mysql://``; ``?table=`` names the records table) or an async SQL store."""
    owned = isinstance(store, str)
    if owned:
        # A relay never creates a SQLite file: an empty one has no outbox to relay.
        store = open_async_store(store, create=False)
    dialect = getattr(store, "dialect", None)
    name = getattr(dialect, "name", None)
    if name == "sqlite":
        return _StoreDb(store, owned=owned)
    if name == "postgresql":
        return _ServerDb(
            name, store, _pg_connector(store), _aclose, owned=owned, timeout=answer_within
        )
    if name == "mysql":
        return _ServerDb(
            name, store, _mysql_connector(store), _close, owned=owned, timeout=answer_within
        )
    if owned:
        with contextlib.suppress(Exception):
            await store.aclose()
    raise ConfigurationError(
        f"the outbox relay needs a SQL store (postgresql://, sqlite:///, mysql://), not"
        f" {type(store).__name__}"
    )


async def _aclose(conn: Any) -> None:
    await conn.close()


async def _close(conn: Any) -> None:
    conn.close()


def _pg_connector(store: Any) -> Callable[[], Awaitable[tuple[Any, Any]]]:
    import psycopg  # noqa: PLC0415 - the store's driver, there already
    from psycopg import IsolationLevel  # noqa: PLC0415

    from ..stores import postgres  # noqa: PLC0415

    connector = store._connector
    if connector is None:
        raise ConfigurationError("the relay takes a PostgreSQL URL, not a store on the app's pool")

    async def connect() -> tuple[Any, Any]:
        try:
            conn = await psycopg.AsyncConnection.connect(connector.conninfo, **connector.kwargs)
        except psycopg.Error as exc:
            raise connector.error(exc) from exc
        # READ COMMITTED whatever the server's default: a claim re-reads a row another relay
        # settled meanwhile instead of failing on it as a serialization conflict.
        await conn.set_isolation_level(IsolationLevel.READ_COMMITTED)
        return conn, postgres._AsyncPsycopgTx(conn)

    return connect


def _mysql_connector(store: Any) -> Callable[[], Awaitable[tuple[Any, Any]]]:
    import aiomysql  # noqa: PLC0415
    import pymysql  # noqa: PLC0415

    from ..stores import cannot_connect, mysql  # noqa: PLC0415

    options = dict(store._options)
    timeout = float(options["connect_timeout"])

    async def connect() -> tuple[Any, Any]:
        try:
            async with asyncio.timeout(timeout):
                conn = await aiomysql.connect(**options)
                # READ COMMITTED: InnoDB's REPEATABLE READ would lock the gaps the claim
                # scanned, and every app transaction staging a message would wait on them
                # until the relay's batch commits.
                async with conn.cursor() as cursor:
                    await cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        except (pymysql.err.Error, OSError, TimeoutError) as exc:
            where = mysql._where(options)
            raise cannot_connect("MariaDB", where, mysql._reason(exc, timeout)) from exc
        try:
            mysql.check_server(mysql._server_version(conn))
        except ConfigurationError:
            conn.close()
            raise
        return conn, mysql._AioMySQLTx(conn, None)

    return connect
