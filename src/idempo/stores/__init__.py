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

Stores plug in by URL scheme: `register` in code, or an ``idempo.stores`` entry point in a
distribution, naming a `StoreKind` (docs/extending.md). idempo's own stores come the same way.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from .._core import record
from .._reexport import publish
from ..errors import ConfigurationError, SchemaMissingError, StoreUnavailableError
from ._registry import StoreKind, find, known_schemes, register
from .base import AsyncStore, AsyncTransactionalStore, Mode, Store, TransactionalStore

__all__ = [
    "AsyncStore",
    "AsyncTransactionalStore",
    "Mode",
    "Store",
    "StoreKind",
    "TransactionalStore",
    "known_schemes",
    "open_async_store",
    "open_store",
    "register",
]

publish(__name__, StoreKind, known_schemes, register)
# The answers a store gives, defined in the call protocol's core: their public home is the
# SPI (named here, where `import idempo` always passes, so they say so before spi is imported).
_answers = (record.Acquired, record.InProgress, record.Mismatch, record.Replay, record.judge)
publish(f"{__name__}.spi", *_answers)
del publish, record, _answers


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
        f" {MIGRATE_HINT}, or in development open it with ?migrate=true"
    )


def cannot_connect(db: str, where: str, reason: str) -> StoreUnavailableError:
    """The error for a server that cannot be reached or refuses the connection."""
    return StoreUnavailableError(f"cannot connect to {db} at {where}: {reason}")


def open_store(
    url: str,
    *,
    read_only: bool = False,
    create: bool = True,
    migrate: bool = False,
    **options: Any,
) -> Store:
    """A synchronous store for ``url``; keyword options go to the store's constructor.

    Args:
        read_only: the store is only read (``get``, ``stats``): a SQLite file is opened
            read-only and never created. Other stores create nothing by reading.
        create: False: a SQLite file must already exist (it is not created empty).
        migrate: create the store's schema now if it is not there (``store.migrate()``,
            which changes nothing once it is), as ``?migrate=true`` in the URL does: for
            development and an embedded SQLite file. In production run ``idempo migrate
            URL`` once, with rights the app need not have.

    The answer is typed as the `Store` protocol, whatever the scheme; the class itself
    (``SQLiteStore(path)``, ``PostgresStore(url)``) is typed as itself, ``migrate`` and
    ``bind`` included.

    >>> open_store("memory://")  # doctest: +ELLIPSIS
    <idempo.stores.memory.MemoryStore object at ...>
    """
    store: Store = _open(url, False, read_only, create, migrate, options)
    return store


def open_async_store(
    url: str,
    *,
    read_only: bool = False,
    create: bool = True,
    migrate: bool = False,
    **options: Any,
) -> AsyncStore:
    """An asynchronous store for ``url`` (the same URLs and arguments as `open_store`).
    ``migrate`` creates the schema before the store is handed back, on a short synchronous
    connection of its own: no event loop is needed yet (a middleware is made at import).

    >>> open_async_store("memory://")  # doctest: +ELLIPSIS
    <idempo.stores.memory.AsyncMemoryStore object at ...>
    """
    store: AsyncStore = _open(url, True, read_only, create, migrate, options)
    return store


def _open(
    url: str, is_async: bool, read_only: bool, create: bool, migrate: bool, options: dict[str, Any]
) -> Any:
    url, cache = _cache_size(url)
    url, asked = _migrate_flag(url)
    if (migrate or asked) and not read_only:
        _migrated(url, options)
    scheme = urlsplit(url).scheme
    kind = find(scheme)
    factory = kind.factory(scheme, is_async=is_async)
    if kind.access_options and (read_only or not create):
        # How a store's file may be opened; on a server a read creates nothing, and the
        # database is there or not, so other stores are not asked.
        options = {"read_only": read_only, "create": create and not read_only, **options}
    try:
        store = factory(url, **options)
    except ValueError as exc:  # a driver's URL parser on a bad port, number or option
        raise ConfigurationError(f"bad {scheme} URL: {exc}") from exc
    if not cache:
        return store
    from . import cache as cached  # noqa: PLC0415 - only URLs that ask for it pay the import

    return (cached.AsyncCachedStore if is_async else cached.CachedStore)(store, max_entries=cache)


def _migrated(url: str, options: dict[str, Any]) -> None:
    """Create the schema of the store at ``url`` if it is not there, through its sync face."""
    scheme = urlsplit(url).scheme
    store = find(scheme).factory(scheme, is_async=False)(url, **options)
    try:
        migrate = getattr(store, "migrate", None)
        if migrate is not None:  # Redis and memory stores have no schema
            migrate()
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()


def _take(url: str, name: str) -> tuple[str, list[str]]:
    """``url`` without its ``name`` parameters, and their values.

    Cut from the text, not re-assembled by urllib, which would rewrite ``sqlite:////abs.db``.

    >>> _take("sqlite:////abs.db?cache=10&migrate=true", "migrate")
    ('sqlite:////abs.db?cache=10', ['true'])
    """
    base, _, query = url.partition("?")
    items = query.split("&") if query else []
    values = [item.partition("=")[2] for item in items if item.partition("=")[0] == name]
    if not values:
        return url, []
    kept = "&".join(item for item in items if item.partition("=")[0] != name)
    return (f"{base}?{kept}" if kept else base), values


def _migrate_flag(url: str) -> tuple[str, bool]:
    """``url`` without its ``migrate`` parameter, and whether it asked for a migration."""
    url, values = _take(url, "migrate")
    if not values:
        return url, False
    if len(values) > 1 or values[0].lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise ConfigurationError(f"migrate= takes true or false, got {'&'.join(values)!r}")
    return url, values[0].lower() in ("true", "1", "yes")


def _cache_size(url: str) -> tuple[str, int]:
    """``url`` without its ``cache`` parameter, and the size that asked for (0: no cache)."""
    url, sizes = _take(url, "cache")
    if not sizes:
        return url, 0
    if len(sizes) > 1 or not (sizes[0].isascii() and sizes[0].isdigit()):
        raise ConfigurationError(f"cache= takes one number of records, got {'&'.join(sizes)!r}")
    return url, int(sizes[0])
