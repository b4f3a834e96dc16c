"""Stores, built from URLs with lazily imported drivers.

    open_store("memory://")
    open_store("sqlite:///relative/path.db")      # or sqlite:////absolute/path.db
    open_store("postgresql://app@db:5432/app")    # needs idempo[postgres]
    open_store("redis://127.0.0.1:6379/0")        # or rediss://; needs idempo[redis]
    open_store("mysql://app@db:3306/app")          # or mariadb://; needs idempo[mysql]
    open_store("redis+cluster://10.0.0.1:7000,10.0.0.2:7000/0")   # Redis Cluster, any seeds

A ``table`` query parameter (``...?table=my_records``) names the records table; for Redis a
``prefix`` query parameter (``redis://host/0?prefix=payments``) names the key prefix.
Any URL takes ``cache=N`` (``redis://host/0?cache=10000``): the store behind a local cache of
up to N settled records (`idempo.stores.cache.CachedStore`); ``cache=0`` means none.
PostgreSQL, MariaDB and Redis URLs take ``connect_timeout`` (seconds, default 5): a server that
is down, refuses or does not answer fails a call within it, and the error says why.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..errors import ConfigurationError, SchemaMissingError, StoreUnavailableError
from .base import AsyncStore, AsyncTransactionalStore, Mode, Store, TransactionalStore

__all__ = [
    "AsyncStore",
    "AsyncTransactionalStore",
    "Mode",
    "Store",
    "TransactionalStore",
    "open_async_store",
    "open_store",
]

# scheme -> (sync class, async class, extra that brings its driver)
_SCHEMES: dict[str, tuple[str, str, str | None]] = {
    "memory": ("idempo.stores.memory:MemoryStore", "idempo.stores.memory:AsyncMemoryStore", None),
    "sqlite": ("idempo.stores.sqlite:SQLiteStore", "idempo.stores.sqlite:AsyncSQLiteStore", None),
    "postgresql": (
        "idempo.stores.postgres:PostgresStore",
        "idempo.stores.postgres:AsyncPostgresStore",
        "postgres",
    ),
}
_SCHEMES["postgres"] = _SCHEMES["postgresql"]
_SCHEMES["redis"] = (
    "idempo.stores.redis:RedisStore",
    "idempo.stores.redis:AsyncRedisStore",
    "redis",
)
_SCHEMES["rediss"] = _SCHEMES["redis"]
_SCHEMES["mysql"] = (
    "idempo.stores.mysql:MySQLStore",
    "idempo.stores.mysql:AsyncMySQLStore",
    "mysql",
)
_SCHEMES["mariadb"] = _SCHEMES["mysql"]


DEFAULT_CONNECT_TIMEOUT = timedelta(seconds=5)


def seconds(value: timedelta | float | str, what: str = "connect_timeout") -> float:
    """A timeout given as a timedelta, a number of seconds or a URL's text, in seconds."""
    try:
        result = value.total_seconds() if isinstance(value, timedelta) else float(value)
    except ValueError as exc:
        raise ConfigurationError(f"{what} takes a number of seconds, got {value!r}") from exc
    if not result > 0:  # also refuses NaN
        raise ConfigurationError(f"{what} must be more than 0 seconds, got {value!r}")
    return result


MIGRATE_HINT = "`idempo migrate <store URL>` (or store.migrate())"


def schema_missing(db: str, what: str) -> SchemaMissingError:
    """The error for a store whose table (or token sequence) is not there: ``what`` names it."""
    return SchemaMissingError(
        f"{db}: {what} does not exist; the store is not migrated: create its schema with"
        f" {MIGRATE_HINT}"
    )


def cannot_connect(db: str, where: str, reason: str) -> StoreUnavailableError:
    """The error for a server that cannot be reached or refuses the connection."""
    return StoreUnavailableError(f"cannot connect to {db} at {where}: {reason}")


def _load(path: str, extra: str | None) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f": pip install 'idempo[{extra}]'" if extra else ""
        raise ConfigurationError(f"cannot load {module_name}{hint}") from exc
    return getattr(module, attr)


def _parse(url: str, which: int) -> tuple[Any, list[Any], dict[str, Any]]:
    parts = urlsplit(url)
    scheme = parts.scheme.split("+", 1)[0]
    if scheme not in _SCHEMES:
        known = ", ".join(sorted(_SCHEMES))
        raise ConfigurationError(f"unknown store URL scheme {parts.scheme!r}; known: {known}")
    sync_path, async_path, extra = _SCHEMES[scheme]
    cls = _load(async_path if which else sync_path, extra)
    query = dict(parse_qsl(parts.query))
    options: dict[str, Any] = {}
    if "table" in query:
        options["table"] = query.pop("table")
    if scheme == "memory":
        return cls, [], options
    if scheme == "sqlite":
        # sqlite:///relative.db -> "relative.db"; sqlite:////abs.db -> "/abs.db"
        path = parts.path[1:] if parts.path.startswith("/") else parts.path
        if not path:
            raise ConfigurationError("a sqlite URL needs a file path: sqlite:///app.db")
        return cls, [path], options
    if scheme in ("redis", "rediss"):
        if "prefix" in query:
            options["prefix"] = query.pop("prefix")
        # The whole scheme: the store tells redis+cluster:// (and refuses other suffixes).
        rest = urlunsplit(
            (parts.scheme, parts.netloc, parts.path, urlencode(query), parts.fragment)
        )
        return cls, [rest], options
    if scheme in ("mysql", "mariadb"):
        rest = urlunsplit((scheme, parts.netloc, parts.path, urlencode(query), parts.fragment))
        return cls, [rest], options
    rest = urlunsplit(("postgresql", parts.netloc, parts.path, urlencode(query), parts.fragment))
    return cls, [rest], options


def open_store(url: str, *, read_only: bool = False, create: bool = True, **options: Any) -> Any:
    """A synchronous store for ``url``; keyword options go to the store's constructor.

    Args:
        read_only: the store is only read (``get``, ``stats``): a SQLite file is opened
            read-only and never created. Other stores create nothing by reading.
        create: False: a SQLite file must already exist (it is not created empty).

    >>> open_store("memory://")  # doctest: +ELLIPSIS
    <idempo.stores.memory.MemoryStore object at ...>
    """
    return _open(url, 0, _access(url, read_only, create, options))


def open_async_store(
    url: str, *, read_only: bool = False, create: bool = True, **options: Any
) -> Any:
    """An asynchronous store for ``url`` (the same URLs and arguments as `open_store`)."""
    return _open(url, 1, _access(url, read_only, create, options))


def _access(url: str, read_only: bool, create: bool, options: dict[str, Any]) -> dict[str, Any]:
    """The constructor options that say how a store's file may be opened: only SQLite has
    one (on a server, a read creates nothing and the database is there or not)."""
    if urlsplit(url).scheme == "sqlite" and (read_only or not create):
        return {"read_only": read_only, "create": create and not read_only, **options}
    return options


def _open(url: str, which: int, options: dict[str, Any]) -> Any:
    url, cache = _cache_size(url)
    cls, args, url_options = _parse(url, which)
    try:
        store = cls(*args, **{**url_options, **options})
    except ValueError as exc:  # a driver's URL parser on a bad port, number or option
        raise ConfigurationError(f"bad {urlsplit(url).scheme} URL: {exc}") from exc
    if not cache:
        return store
    from . import cache as cached  # noqa: PLC0415 - only URLs that ask for it pay the import

    return (cached.AsyncCachedStore if which else cached.CachedStore)(store, max_entries=cache)


def _cache_size(url: str) -> tuple[str, int]:
    """``url`` without its ``cache`` parameter, and the size that asked for (0: no cache).

    Cut from the text, not re-assembled by urllib, which would rewrite ``sqlite:////abs.db``.
    """
    base, _, query = url.partition("?")
    items = query.split("&") if query else []
    sizes = [item.partition("=")[2] for item in items if item.partition("=")[0] == "cache"]
    if not sizes:
        return url, 0
    if len(sizes) > 1 or not (sizes[0].isascii() and sizes[0].isdigit()):
        raise ConfigurationError(f"cache= takes one number of records, got {'&'.join(sizes)!r}")
    kept = "&".join(item for item in items if item.partition("=")[0] != "cache")
    return (f"{base}?{kept}" if kept else base), int(sizes[0])
