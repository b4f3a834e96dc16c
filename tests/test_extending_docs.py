"""docs/extending.md, "Writing a store", runs as written: its files are the out-of-tree store
and its contract test (tests/outside_store, which the suite runs), and its entry-point table is
the one a distribution declares. Its other snippets run in tests/test_docs.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

DOC = Path(__file__).parent.parent / "docs" / "extending.md"
OUTSIDE = Path(__file__).parent / "outside_store"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def store_section() -> str:
    """The store half of the page (the framework half, after it, has its own test)."""
    text = DOC.read_text()
    start = text.index("\n## Writing a store\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def blocks(language: str) -> list[str]:
    return [code for lang, code in FENCE.findall(store_section()) if lang == language]


def test_the_files_shown_are_the_store_and_test_that_run() -> None:
    """Every ```python block that starts with ``# name.py`` is that file of
    tests/outside_store, to the letter."""
    shown = {
        code.partition("\n")[0].removeprefix("# "): code.partition("\n")[2]
        for code in blocks("python")
        if re.match(r"# \w+\.py\n", code)
    }
    assert set(shown) == {"dictstore.py", "test_dictstore.py"}
    for name, code in shown.items():
        assert code == (OUTSIDE / name).read_text(), f"docs/extending.md shows another {name}"


def test_the_entry_point_table_is_what_a_distribution_declares() -> None:
    """The ```toml block is a valid pyproject.toml table naming dictstore's KIND, the entry
    point tests/test_store_plugins.py installs."""
    (table,) = blocks("toml")
    declared = tomllib.loads(table)["project"]["entry-points"]["idempo.stores"]
    assert declared == {"dict": "dictstore:KIND"}


def test_the_contract_runs_as_shown_outside_this_repository(tmp_path: Path) -> None:
    """The two files, alone in a directory of their own (no conftest, no idempo test
    fixtures), pass the contract with the count the page shows."""
    for name in ("dictstore.py", "test_dictstore.py"):
        (tmp_path / name).write_text((OUTSIDE / name).read_text())
    # Only anyio's plugin: the others installed here (schemathesis, hypothesis...) take
    # seconds to load and have nothing to do with the contract.
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "anyio", "-p", "no:cacheprovider",
         "-c", os.devnull, "--rootdir", str(tmp_path), "test_dictstore.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (shown,) = re.findall(r"^(\d+) passed in", store_section(), re.MULTILINE)
    assert f"{shown} passed" in run.stdout


def test_the_worked_example_passes_mypy_strict() -> None:
    """The store and its test type-check under ``mypy --strict``: `StoreKind`'s faces are
    typed as the store protocols, so a store missing a verb is a type error at ``KIND``."""
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", str(OUTSIDE)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
