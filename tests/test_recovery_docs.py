"""docs/recovery-points.md runs as written: its ```python blocks, in order, as one script,
print what the page says they print."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from pathlib import Path

import pytest

DOC = Path(__file__).parent.parent / "docs" / "recovery-points.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
# What a block prints is shown under it as comments starting in the first column; the
# comments that explain follow the code on its line.
SHOWN = re.compile(r"^# (?!continues the block above$)(.*)$", re.MULTILINE)


def blocks() -> list[str]:
    return [code for language, code in FENCE.findall(DOC.read_text()) if language == "python"]


def test_the_page_has_the_worked_example() -> None:
    codes = blocks()
    assert len(codes) >= 6
    text = DOC.read_text()
    for topic in ("atomic phases", "Leased mode only", "downstream_key", "Limits",
                  "16 KiB", "FingerprintMismatchError", "ConfigurationError"):  # fmt: skip
        assert topic in text, topic


def test_every_block_runs_in_order_and_prints_what_it_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "recovery_points_doc"}
    try:
        for number, code in enumerate(blocks()):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"{DOC} block {number}", "exec"), namespace)  # the page's code
            printed = out.getvalue().splitlines()
            shown = SHOWN.findall(code)
            # A message wrapped over several comment lines is one printed line.
            assert " ".join(printed) == " ".join(shown), f"block {number}"
    finally:
        for name in ("conn", "store"):
            closing = getattr(namespace.get(name), "close", None)
            if closing is not None:
                closing()
        made = namespace.get("directory")  # the page's temporary directory
        if isinstance(made, Path):
            shutil.rmtree(made, ignore_errors=True)
