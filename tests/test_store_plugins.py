"""Stores plug in from outside: by entry point (a real distribution's metadata on sys.path) or
by `register()`, with clear errors for every way a plug can be wrong; the store SPI is public
and idempo's own stores come through the same registry."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import idempo
from idempo import ConfigurationError, StoreUnavailableError
from idempo.stores import (
    StoreKind,
    _registry,
    known_schemes,
    open_async_store,
    open_store,
    register,
)
from idempo.stores.memory import AsyncMemoryStore, MemoryStore

ROOT = Path(__file__).parent.parent
OUTSIDE = Path(__file__).parent / "outside_store"


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with nothing registered in code, and leaves nothing behind."""
    monkeypatch.setattr(_registry, "_registered", {})


def install(where: Path, name: str, entries: dict[str, str]) -> Path:
    """A distribution ``name`` installed in ``where`` (its ``.dist-info``, as pip would leave
    it) whose ``idempo.stores`` entry points are ``entries``."""
    info = where / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "".join(f"{scheme} = {value}\n" for scheme, value in entries.items())
    (info / "entry_points.txt").write_text(f"[idempo.stores]\n{lines}")
    return where


@pytest.fixture
def dictstore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """tests/outside_store installed as the distribution ``dictstore``, naming ``dict://``."""
    monkeypatch.syspath_prepend(str(OUTSIDE))
    monkeypatch.syspath_prepend(
        str(install(tmp_path / "site", "dictstore", {"dict": "dictstore:KIND"}))
    )
    import dictstore  # importable only once its directory is on the path

    return dictstore


def test_an_entry_point_plugs_a_store_in(dictstore: Any) -> None:
    """A distribution's ``idempo.stores`` entry point makes its scheme open its store, in
    both faces, and the scheme is known; nothing was registered in code."""
    assert isinstance(open_store("dict://"), dictstore.DictStore)
    assert isinstance(open_async_store("dict://"), dictstore.AsyncDictStore)
    assert "dict" in known_schemes()
    assert _registry._registered == {}
    cached = open_store("dict://?cache=10")
    assert type(cached).__name__ == "CachedStore"


def test_an_uninstalled_distribution_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan follows sys.path: a plugin directory removed from it takes its schemes along."""
    with monkeypatch.context() as patch:
        patch.syspath_prepend(
            str(install(tmp_path, "gone", {"gone": "idempo.stores._builtin:MEMORY"}))
        )
        assert isinstance(open_store("gone://"), MemoryStore)
    assert "gone" not in known_schemes()
    with pytest.raises(ConfigurationError, match="unknown store URL scheme 'gone'"):
        open_store("gone://")


def test_register_plugs_a_store_in_and_wins_over_entry_points(dictstore: Any) -> None:
    """register() opens a scheme from code, and wins over an installed entry point."""
    register("dict", StoreKind(open=lambda url, **options: MemoryStore()))
    assert isinstance(open_store("dict://"), MemoryStore)
    with pytest.raises(ConfigurationError, match="has no async store; open it with open_store"):
        open_async_store("dict://")


def test_a_store_kind_with_one_face_refuses_the_other() -> None:
    """An async-only scheme says so when a sync store is asked for."""
    register("aonly", StoreKind(open_async=lambda url: AsyncMemoryStore()))
    assert isinstance(open_async_store("aonly://"), AsyncMemoryStore)
    with pytest.raises(
        ConfigurationError, match="has no sync store; open it with open_async_store"
    ):
        open_store("aonly://")


def test_factories_get_the_whole_url_and_the_options() -> None:
    """The factory gets the URL as written (``+variant`` included, idempo's ``cache=`` cut)
    and the caller's options; ``driver+variant://`` falls back to ``driver``."""
    calls: list[tuple[str, dict[str, Any]]] = []

    def build(url: str, **options: Any) -> MemoryStore:
        calls.append((url, options))
        return MemoryStore()

    register("echo", StoreKind(open=build))
    open_store("echo+fast://host:1/db?x=1&cache=3", size=2)
    register("echo+exact", StoreKind(open=lambda url: MemoryStore()))
    open_store("echo+exact://")
    assert calls == [("echo+fast://host:1/db?x=1", {"size": 2})]


def test_read_only_and_create_reach_only_stores_kept_in_files(tmp_path: Path) -> None:
    """``read_only=``/``create=`` go to a factory that says it takes them, and to no other."""
    seen: list[dict[str, Any]] = []
    register("plain", StoreKind(open=lambda url, **options: seen.append(options) or MemoryStore()))
    register(
        "filed",
        StoreKind(
            open=lambda url, **options: seen.append(options) or MemoryStore(), access_options=True
        ),
    )
    open_store("plain://", read_only=True)
    open_store("filed://", read_only=True)
    open_store("filed://")
    assert seen == [{}, {"read_only": True, "create": False}, {}]
    with pytest.raises(StoreUnavailableError, match="the file does not exist"):
        open_store(f"sqlite:///{tmp_path / 'none.db'}", create=False).stats()
    assert not (tmp_path / "none.db").exists()


def test_unknown_scheme_names_every_known_one(dictstore: Any) -> None:
    """An unknown scheme is a ConfigurationError listing the known schemes, plugins
    included, and how to plug one in; there is no fallback to another store."""
    with pytest.raises(ConfigurationError) as caught:
        open_store("mongodb+srv://db/x")
    message = str(caught.value)
    assert "unknown store URL scheme 'mongodb+srv'" in message
    assert (
        "known: dict, mariadb, memory, mysql, postgres, postgresql, redis, rediss, sqlite"
        in message
    )
    assert "idempo.stores.register()" in message
    assert "'idempo.stores' entry point" in message


def test_two_distributions_claiming_one_scheme_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two installed distributions naming one scheme differently are refused, naming both;
    register() settles it. Neither can take over one of idempo's own schemes quietly."""
    monkeypatch.syspath_prepend(
        str(install(tmp_path / "a", "alpha", {"twin": "idempo.stores._builtin:MEMORY"}))
    )
    monkeypatch.syspath_prepend(
        str(
            install(
                tmp_path / "b",
                "beta",
                {"twin": "idempo.stores._builtin:SQLITE", "redis": "idempo.stores._builtin:MEMORY"},
            )
        )
    )
    with pytest.raises(
        ConfigurationError, match=r"'twin' is claimed by more than one.*\(alpha\).*\(beta\)"
    ):
        open_store("twin://")
    with pytest.raises(ConfigurationError, match=r"'redis' is claimed.*\(beta\).*\(idempo\)"):
        open_store("redis://127.0.0.1:6379/0")
    register("twin", StoreKind(open=lambda url: MemoryStore()))
    assert isinstance(open_store("twin://"), MemoryStore)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("no_such_module_anywhere:KIND", r"cannot load the store for bad://.*no_such_module"),
        ("idempo.stores._builtin:NOPE", r"cannot load the store for bad://"),
        (
            "idempo.stores.memory:MemoryStore",
            r"names idempo.stores.memory:MemoryStore, which is not a StoreKind",
        ),
    ],
)
def test_a_broken_entry_point_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, error: str
) -> None:
    """An entry point that cannot be loaded, or names something else, says which and why."""
    monkeypatch.syspath_prepend(str(install(tmp_path, "broken", {"bad": value})))
    with pytest.raises(ConfigurationError, match=error):
        open_store("bad://")


@pytest.mark.parametrize("scheme", ["", "Dict", "1db", "my store", "d/b"])
def test_register_refuses_what_cannot_be_a_scheme(scheme: str) -> None:
    """A scheme a URL could never carry is refused when registered, and so is a non-kind."""
    with pytest.raises(ConfigurationError):
        register(scheme, StoreKind(open=lambda url: MemoryStore()))
    with pytest.raises(ConfigurationError, match="takes a StoreKind"):
        register("ok", MemoryStore)  # type: ignore[arg-type]


def test_idempo_declares_its_own_stores_as_entry_points() -> None:
    """pyproject.toml names idempo's stores under ``idempo.stores`` exactly as the registry
    knows them, and the installed metadata (once reinstalled) says the same."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project.get("entry-points", {}).get("idempo.stores")
    if declared is None:
        pytest.skip(
            'pyproject.toml has no [project.entry-points."idempo.stores"] yet (H4\'s Request)'
        )
    assert declared == _registry.BUILTIN
    installed = {
        entry.name: entry.value
        for entry in _registry._installed().values()
        for entry in entry
        if getattr(entry.dist, "name", None) == "idempo"
    }
    assert installed in ({}, _registry.BUILTIN)


def test_the_spi_is_public_and_the_old_paths_still_work() -> None:
    """A store author imports everything from idempo.stores.spi; the private paths it came
    from name the same objects."""
    from idempo._core import record
    from idempo.stores import spi

    for name in (
        "Acquired",
        "Replay",
        "Mismatch",
        "InProgress",
        "Reservation",
        "Record",
        "Status",
        "judge",
    ):
        assert getattr(spi, name) is getattr(record, name), name
    assert spi.Scope is idempo.Scope
    assert spi.Store is idempo.Store
    assert spi.FencedError is idempo.FencedError
    assert spi.StoreKind is StoreKind
    for name in ("Acquired", "Replay", "Mismatch", "InProgress", "judge"):  # their public home
        assert getattr(spi, name).__module__ == "idempo.stores.spi", name
    assert (StoreKind.__module__, register.__module__) == ("idempo.stores", "idempo.stores")
    assert sorted(spi.__all__) == spi.__all__
    # (names pytest's assertion rewriting adds, when spi.py is named on its command line, are
    # not identifiers)
    public = {name for name in dir(spi) if name.isidentifier() and not name.startswith("_")}
    assert public - {"annotations"} == set(spi.__all__)


def test_importing_idempo_imports_no_test_framework() -> None:
    """``import idempo`` (and idempo.testing for FakeClock, and the SPI) leaves pytest and
    anyio unimported; only StoreContract brings pytest."""
    code = (
        "import sys, idempo, idempo.testing, idempo.stores.spi\n"
        "from idempo.testing import FakeClock\n"
        "assert 'pytest' not in sys.modules, 'pytest'\n"
        "from idempo.testing import StoreContract\n"
        "assert 'pytest' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


OPTIONAL = [
    ("idempo.stores.postgres", "psycopg_pool", "the PostgreSQL store needs psycopg", "postgres"),
    ("idempo.stores.mysql", "aiomysql", "the MariaDB/MySQL store needs PyMySQL and", "mysql"),
    (
        "idempo.stores._sql.sqlalchemy",
        "sqlalchemy",
        "binding a SQLAlchemy session needs",
        "sqlalchemy",
    ),
    ("idempo.client", "httpx", "the idempotent client needs httpx", "httpx"),
    ("idempo.contrib.aio_pika", "aio_pika", "idempo.contrib.aio_pika needs aio-pika", "rabbitmq"),
    ("idempo.contrib.faststream", "faststream", "idempo.contrib.faststream needs", "faststream"),
]


def test_a_missing_driver_names_the_extra_to_install() -> None:
    """Each module behind an extra, imported without its driver, raises ConfigurationError
    naming the extra (the one guard in idempo._optional); so does opening a store URL whose
    driver is missing. Checked in a child whose imports of the drivers fail."""
    code = (
        "import importlib, sys\n"
        "from idempo.errors import ConfigurationError\n"
        f"cases = {OPTIONAL!r}\n"
        "for module, driver, what, extra in cases:\n"
        "    sys.modules[driver] = None\n"
        "    try:\n"
        "        importlib.import_module(module)\n"
        "    except ConfigurationError as exc:\n"
        "        assert what in str(exc) and f\"pip install 'idempo[{extra}]'\" in str(exc), exc\n"
        "        assert isinstance(exc.__cause__, ImportError), exc.__cause__\n"
        "    else:\n"
        "        raise AssertionError(module)\n"
        "sys.modules['redis'] = None\n"
        "from idempo import open_store\n"
        "try:\n"
        "    open_store('redis://127.0.0.1:6379/0')\n"
        "except ConfigurationError as exc:\n"
        "    assert \"pip install 'idempo[redis]'\" in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('redis')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
