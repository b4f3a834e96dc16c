"""Which store a URL scheme names: stores plug in by scheme, from code or from a distribution.

A scheme is found, in this order, among

1. the schemes registered in code (`register`): the app's explicit choice, which wins;
2. the ``idempo.stores`` entry points of the installed distributions, idempo's own included
   (idempo's are also known from `BUILTIN`, so a source tree with no installed metadata opens
   the same stores). Two distributions that name one scheme differently are an error, not a
   silent pick: installing a package never takes over ``postgresql://`` behind the app's back.

``driver+variant://`` (``redis+cluster://``, ``postgresql+psycopg://``) is looked up whole
first, then by the part before the ``+``; the store's factory gets the whole URL.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from ..errors import ConfigurationError
from .base import AsyncStore, Store

__all__ = ["BUILTIN", "GROUP", "StoreKind", "find", "known_schemes", "register"]

GROUP = "idempo.stores"
"""The entry-point group a distribution names its stores in, one entry per URL scheme."""


@dataclass(frozen=True, slots=True)
class StoreKind:
    """How one URL scheme builds its stores: a factory per face, each ``(url, **options)``.

    ``open`` builds the synchronous store (`open_store`), ``open_async`` the asynchronous one
    (`open_async_store`); a face left None is refused with a clear error. A factory gets the
    whole URL (without idempo's own ``cache=``) and the caller's keyword options, and raises
    `ConfigurationError` (or ``ValueError``) for a URL it cannot use. ``access_options``:
    the factory also takes ``read_only=`` and ``create=`` (a store kept in a file); others
    create nothing by reading and are never passed them.

    >>> from idempo.stores.memory import MemoryStore
    >>> kind = StoreKind(open=lambda url, **options: MemoryStore())
    >>> kind.factory("scratch", is_async=False)("scratch://")  # doctest: +ELLIPSIS
    <idempo.stores.memory.MemoryStore object at ...>
    >>> kind.factory("scratch", is_async=True)
    Traceback (most recent call last):
    ...
    idempo.errors.ConfigurationError: scratch:// has no async store; open it with open_store
    """

    open: Callable[..., Store] | None = None
    open_async: Callable[..., AsyncStore] | None = None
    access_options: bool = False

    def factory(self, scheme: str, *, is_async: bool) -> Callable[..., Any]:
        """The face asked for, or a `ConfigurationError` saying the scheme has none."""
        face = self.open_async if is_async else self.open
        if face is None:
            missing, other = ("async", "open_store") if is_async else ("sync", "open_async_store")
            raise ConfigurationError(f"{scheme}:// has no {missing} store; open it with {other}")
        return face


# idempo's own stores, exactly as pyproject.toml names them under [project.entry-points.
# "idempo.stores"] (a test keeps the two equal).
BUILTIN: dict[str, str] = {
    "mariadb": "idempo.stores._builtin:MYSQL",
    "memory": "idempo.stores._builtin:MEMORY",
    "mysql": "idempo.stores._builtin:MYSQL",
    "postgres": "idempo.stores._builtin:POSTGRES",
    "postgresql": "idempo.stores._builtin:POSTGRES",
    "redis": "idempo.stores._builtin:REDIS",
    "rediss": "idempo.stores._builtin:REDIS",
    "sqlite": "idempo.stores._builtin:SQLITE",
}

_registered: dict[str, StoreKind] = {}
_loaded: dict[str, StoreKind] = {}  # entry-point value -> what it names
# The installed entry points by scheme, scanned once per sys.path (a scan reads every
# distribution's metadata, about 10 ms): a path added later (a plugin directory, a test's
# temporary distribution) is seen on the next lookup.
_scanned: tuple[tuple[str, ...], dict[str, list[EntryPoint]]] | None = None


def register(scheme: str, kind: StoreKind) -> None:
    """Open ``scheme://`` URLs with ``kind``, from now on, in this process.

    It wins over every entry point, idempo's own included, and replaces an earlier
    registration of the same scheme.

        register("dict", StoreKind(open=DictStore.from_url, open_async=AsyncDictStore.from_url))
        open_store("dict://")   # a DictStore
    """
    if not isinstance(kind, StoreKind):
        raise ConfigurationError(f"register({scheme!r}, ...) takes a StoreKind, not {kind!r}")
    _registered[_checked(scheme)] = kind


def _checked(scheme: str) -> str:
    if (
        not scheme
        or scheme != scheme.lower()
        or not scheme[0].isalpha()
        or not all(char.isalnum() or char in "+-." for char in scheme)
    ):
        raise ConfigurationError(
            f"a store scheme is lower-case letters, digits, '+', '-' and '.', got {scheme!r}"
        )
    return scheme


def _installed() -> dict[str, list[EntryPoint]]:
    global _scanned  # noqa: PLW0603 - one cache for the process, keyed on sys.path
    path = tuple(sys.path)
    if _scanned is None or _scanned[0] != path:
        found: dict[str, list[EntryPoint]] = {}
        for entry in entry_points(group=GROUP):
            found.setdefault(entry.name, []).append(entry)
        _scanned = (path, found)
    return _scanned[1]


def known_schemes() -> list[str]:
    """Every scheme a store URL may start with here, sorted.

    >>> [scheme for scheme in known_schemes() if scheme.startswith("m")]
    ['mariadb', 'memory', 'mysql']
    """
    return sorted({*_registered, *_installed(), *BUILTIN})


def find(scheme: str) -> StoreKind:
    """The kind of store ``scheme`` names (whole, then the part before a ``+``)."""
    for name in dict.fromkeys((scheme, scheme.split("+", 1)[0])):
        if name in _registered:
            return _registered[name]
        values = {entry.value: _origin(entry) for entry in _installed().get(name, [])}
        if name in BUILTIN:
            values.setdefault(BUILTIN[name], "idempo")
        if len(values) > 1:
            claims = "; ".join(f"{value} ({origin})" for value, origin in sorted(values.items()))
            raise ConfigurationError(
                f"store URL scheme {name!r} is claimed by more than one distribution: {claims};"
                f" choose one with idempo.stores.register({name!r}, ...)"
            )
        if values:
            return _load(name, next(iter(values)))
    raise ConfigurationError(
        f"unknown store URL scheme {scheme!r}; known: {', '.join(known_schemes())}"
        f" (a store plugs in with idempo.stores.register() or an {GROUP!r} entry point)"
    )


def _origin(entry: EntryPoint) -> str:
    dist = getattr(entry, "dist", None)
    return dist.name if dist is not None else "an unnamed distribution"


def _load(scheme: str, value: str) -> StoreKind:
    if value not in _loaded:
        try:
            kind = EntryPoint(scheme, value, GROUP).load()
        except (ImportError, AttributeError) as exc:
            raise ConfigurationError(
                f"cannot load the store for {scheme}:// ({value}): {exc}"
            ) from exc
        if not isinstance(kind, StoreKind):
            raise ConfigurationError(
                f"the {GROUP!r} entry point {scheme!r} names {value}, which is not a"
                " StoreKind (idempo.stores.spi.StoreKind)"
            )
        _loaded[value] = kind
    return _loaded[value]
