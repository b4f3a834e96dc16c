"""docs/idempotent-by-construction.md runs as written: every ```python block, in order, each
in a fresh namespace (each block stands alone, as a reader would copy it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).parent.parent / "docs" / "idempotent-by-construction.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
BLOCKS = [code for lang, code in FENCE.findall(DOC.read_text()) if lang == "python"]


def test_the_page_has_its_examples() -> None:
    assert len(BLOCKS) >= 7


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{n}" for n in range(len(BLOCKS))])
def test_every_python_block_runs(
    code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # anything a block writes lands in the test's own directory
    exec(compile(code, str(DOC), "exec"), {"__name__": "__doc_example__"})  # the page's own code
