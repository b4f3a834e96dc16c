"""Internal review: a store that stops answering after the store's connections were made
(a network partition, a frozen server), through a loopback TCP proxy in front of the real
PostgreSQL, MariaDB and Redis servers.

Each defect the review found was first a test marked ``xfail(strict=True)``; the mark came
off with its fix (docs/testing.md). The other tests are checks that held.
"""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from helpers import new_key
from idempo import AsyncIdempotency, Idempotency, StoreError, StoreUnavailableError
from idempo.stores.mysql import AsyncMySQLStore, MySQLStore
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore
from idempo.stores.redis import RedisStore

# How long a call on a frozen store may take before the test calls it a hang: the default
# connect timeout (5 s) plus room.
BOUND = 12.0


class FreezingProxy:
    """Forwards TCP to ``target`` until frozen; frozen, it reads nothing and sends nothing,
    keeping every connection open (what a partition or a stopped server looks like)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.frozen = threading.Event()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, None)
        while not self.closed.is_set():
            for key, _ in sel.select(timeout=0.05):
                if key.data is None:
                    client, _ = self.listener.accept()
                    upstream = socket.create_connection(self.target)
                    self.sockets += [client, upstream]
                    sel.register(client, selectors.EVENT_READ, upstream)
                    sel.register(upstream, selectors.EVENT_READ, client)
                    continue
                if self.frozen.is_set():
                    continue
                try:
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                key.data.sendall(data)
            if self.frozen.is_set():
                time.sleep(0.05)
        sel.close()

    def close(self) -> None:
        self.closed.set()
        self.thread.join(5)
        for sock in [*self.sockets, self.listener]:
            with suppress(OSError):
                sock.close()


def through(url: str, proxy: FreezingProxy) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{proxy.port}"
    return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))


@contextmanager
def proxied(url: str) -> Iterator[tuple[str, FreezingProxy]]:
    parts = urlsplit(url)
    proxy = FreezingProxy((parts.hostname or "127.0.0.1", parts.port or 0))
    try:
        yield through(url, proxy), proxy
    finally:
        proxy.close()


def call_while_frozen(proxy: FreezingProxy, call: Callable[[], Any]) -> tuple[float, Any]:
    """Freeze the proxy, make ``call`` in a thread, and say how long it took (BOUND if it
    was still waiting then) and what it raised. The proxy's sockets are closed afterwards,
    which ends a call still waiting."""
    proxy.frozen.set()
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        future = pool.submit(call)
        try:
            future.result(timeout=BOUND)
        except TimeoutError:
            proxy.close()
            return BOUND, "still waiting"
        except Exception as exc:  # reported to the test
            return time.monotonic() - started, exc
        return time.monotonic() - started, None


def guarded_call(store: Any) -> None:
    with Idempotency(store).once(new_key(), operation="review.partition") as attempt:
        attempt.result = "ran"


def _frozen_store_call(make_store: Callable[[str], Any], url: str) -> tuple[float, Any]:
    with proxied(url) as (via, proxy):
        store = make_store(via)
        try:
            guarded_call(store)  # the pool now holds a live connection through the proxy
            return call_while_frozen(proxy, lambda: guarded_call(store))
        finally:
            proxy.close()
            with suppress(Exception):  # the proxy is gone: nothing left to close cleanly
                store.close()


@pytest.mark.postgres
def test_frozen_postgres_fails_within_a_bound(postgres_url: str, pg_schema: str) -> None:
    """SPEC §8: an unreachable store fails within a connect timeout (5 s by default), with
    StoreUnavailableError; here it is reachable at connect time and unreachable after."""

    def make(url: str) -> Any:
        store = PostgresStore(url, table=f"{pg_schema}.idempo_records", max_size=1)
        store.migrate()
        return store

    elapsed, raised = _frozen_store_call(make, postgres_url)
    assert isinstance(raised, StoreUnavailableError), (raised, round(elapsed, 1))
    # The default: the connect timeout (5 s) past the lock timeout (5 s).
    assert "did not answer within 5 s" in str(raised)
    assert elapsed < BOUND


@pytest.mark.mysql
def test_frozen_mysql_fails_within_a_bound(mysql_url: str, mysql_db: str) -> None:
    """The same on MariaDB: the store bounds the login by the connect timeout, then clears
    PyMySQL's read timeout, so a frozen server holds the call until TCP gives up."""

    def make(url: str) -> Any:
        store = MySQLStore(url, table=f"{mysql_db}.idempo_records", max_size=1)
        store.migrate()
        return store

    elapsed, raised = _frozen_store_call(make, mysql_url)
    assert isinstance(raised, StoreUnavailableError), (raised, round(elapsed, 1))
    assert elapsed < BOUND


@pytest.mark.redis
def test_frozen_redis_fails_within_a_bound(redis_url: str, redis_prefix: str) -> None:
    """A check that held: Redis bounds every command by socket_timeout (5 s)."""
    elapsed, raised = _frozen_store_call(
        lambda url: RedisStore(url, prefix=redis_prefix), redis_url
    )
    assert isinstance(raised, StoreError), (raised, round(elapsed, 1))
    assert elapsed < BOUND


# -- the fix's own checks: the bound is configurable, and the async stores keep it too ---------

# read_timeout=2 is counted past the lock wait the call could be in (5 s by default).
LOCK_WAIT = 5.0


async def aguarded_call(store: Any) -> None:
    async with AsyncIdempotency(store).once(new_key(), operation="review.partition") as attempt:
        attempt.result = "ran"


def _frozen_async_store_call(make_store: Callable[[str], Any], url: str) -> tuple[float, Any]:
    """`_frozen_store_call` for an async store: one call through the proxy, then one while
    it is frozen, in one event loop; a hang fails the test at BOUND."""

    async def scenario(via: str, proxy: FreezingProxy) -> tuple[float, Any]:
        store = make_store(via)
        try:
            await aguarded_call(store)
            proxy.frozen.set()
            started = time.monotonic()
            try:
                await aguarded_call(store)
            except Exception as exc:  # reported to the test
                return time.monotonic() - started, exc
            return time.monotonic() - started, None
        finally:
            proxy.close()
            with suppress(Exception):
                await store.aclose()

    with proxied(url) as (via, proxy):
        return asyncio.run(asyncio.wait_for(scenario(via, proxy), BOUND))


STORES = {"postgres": (PostgresStore, AsyncPostgresStore), "mysql": (MySQLStore, AsyncMySQLStore)}


def _url_and_table(kind: str, request: pytest.FixtureRequest) -> tuple[str, str]:
    """The server's URL and a fresh records table on it, migrated."""
    if kind == "postgres":
        url = request.getfixturevalue("postgres_url")
        table = f"{request.getfixturevalue('pg_schema')}.idempo_records"
    else:
        url = request.getfixturevalue("mysql_url")
        table = f"{request.getfixturevalue('mysql_db')}.idempo_records"
    store = STORES[kind][0](url, table=table)
    try:
        store.migrate()
    finally:
        store.close()
    return url, table


KINDS = [
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mysql", marks=pytest.mark.mysql),
]


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_store_fails_within_its_read_timeout(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url, table = _url_and_table(kind, request)
    elapsed, raised = _frozen_store_call(
        lambda via: STORES[kind][0](via, table=table, max_size=1, read_timeout=2), url
    )
    assert isinstance(raised, StoreUnavailableError), (raised, round(elapsed, 1))
    assert 2 + LOCK_WAIT - 0.1 < elapsed < 2 + LOCK_WAIT + 2, elapsed


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_async_store_fails_within_its_read_timeout(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url, table = _url_and_table(kind, request)
    elapsed, raised = _frozen_async_store_call(
        lambda via: STORES[kind][1](via, table=table, max_size=1, read_timeout=2), url
    )
    assert isinstance(raised, StoreUnavailableError), (raised, round(elapsed, 1))
    assert "did not answer within 2 s" in str(raised)
    assert 2 + LOCK_WAIT - 0.1 < elapsed < 2 + LOCK_WAIT + 2, elapsed


def test_mysql_url_takes_a_read_timeout() -> None:
    store = MySQLStore("mysql://app@127.0.0.1:1/app?read_timeout=2.5")
    assert store.read_timeout == timedelta(seconds=2.5)
    store.close()
