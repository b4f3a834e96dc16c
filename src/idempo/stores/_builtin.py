"""idempo's own stores as `StoreKind` values: what each URL scheme's URL means to its store.

Plugged in through the same registry as anyone's (pyproject.toml names these under the
``idempo.stores`` entry points). The store classes are imported only when a URL of theirs is
opened, so a missing driver is a `ConfigurationError` naming the extra to install, and
``import idempo`` costs no driver.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit, urlunsplit

from .._optional import optional_import
from ..errors import ConfigurationError
from ._registry import StoreKind

__all__ = ["MEMORY", "MYSQL", "POSTGRES", "REDIS", "SQLITE"]

# A URL's parts and its query (``table`` already taken out) -> constructor arguments.
Parse = Callable[[SplitResult, dict[str, str]], tuple[list[Any], dict[str, Any]]]


def _builder(path: str, extra: str | None, parse: Parse) -> Callable[..., Any]:
    """A factory ``(url, **options)`` that imports the class at ``path`` and builds it."""
    module_name, _, attr = path.partition(":")

    def build(url: str, **options: Any) -> Any:
        with optional_import(f"cannot load {module_name}", extra=extra):
            cls = getattr(importlib.import_module(module_name), attr)
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        url_options: dict[str, Any] = {"table": query.pop("table")} if "table" in query else {}
        args, parsed = parse(parts, query)
        return cls(*args, **{**url_options, **parsed, **options})

    build.__qualname__ = build.__name__ = f"build_{attr}"
    return build


def _kind(module: str, name: str, extra: str | None, parse: Parse, **flags: Any) -> StoreKind:
    """The sync ``Name`` and async ``AsyncName`` of ``idempo.stores.<module>``."""
    sync = _builder(f"idempo.stores.{module}:{name}", extra, parse)
    async_ = _builder(f"idempo.stores.{module}:Async{name}", extra, parse)
    return StoreKind(open=sync, open_async=async_, **flags)


def _nothing(parts: SplitResult, query: dict[str, str]) -> tuple[list[Any], dict[str, Any]]:
    return [], {}


def _file_path(parts: SplitResult, query: dict[str, str]) -> tuple[list[Any], dict[str, Any]]:
    # sqlite:///relative.db -> "relative.db"; sqlite:////abs.db -> "/abs.db"
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    if not path:
        raise ConfigurationError("a sqlite URL needs a file path: sqlite:///app.db")
    return [path], {}


def _redis_url(parts: SplitResult, query: dict[str, str]) -> tuple[list[Any], dict[str, Any]]:
    options = {"prefix": query.pop("prefix")} if "prefix" in query else {}
    # The whole scheme: the store tells redis+cluster:// (and refuses other suffixes).
    return [_rebuilt(parts, parts.scheme, query)], options


def _server_url(scheme: str | None) -> Parse:
    """The URL for a driver that knows one spelling of its scheme (None: the base one)."""

    def parse(parts: SplitResult, query: dict[str, str]) -> tuple[list[Any], dict[str, Any]]:
        return [_rebuilt(parts, scheme or parts.scheme.split("+", 1)[0], query)], {}

    return parse


def _rebuilt(parts: SplitResult, scheme: str, query: dict[str, str]) -> str:
    return urlunsplit((scheme, parts.netloc, parts.path, urlencode(query), parts.fragment))


MEMORY = _kind("memory", "MemoryStore", None, _nothing)
SQLITE = _kind("sqlite", "SQLiteStore", None, _file_path, access_options=True)
POSTGRES = _kind("postgres", "PostgresStore", "postgres", _server_url("postgresql"))
REDIS = _kind("redis", "RedisStore", "redis", _redis_url)
MYSQL = _kind("mysql", "MySQLStore", "mysql", _server_url(None))
