"""docs/problems.md lists every problem type idempo's code can answer, and no other: a new
``problem(..., "kind", ...)`` or `problem_for` branch without its row fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

from idempo._http.problems import problem_for
from idempo._wire import PROBLEM_TYPE_BASE
from idempo.errors import IdempotencyError

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src" / "idempo"
PAGE = ROOT / "docs" / "problems.md"

# problem(400, "missing-key", ...), problem(mismatch_status, "fingerprint-mismatch", ...),
# over several lines too; and the URNs written out whole, as string literals.
MADE = re.compile(r"\bproblem\(\s*[\w.]+,\s*\"([a-z0-9-]+)\"")
WRITTEN = re.compile(re.escape(PROBLEM_TYPE_BASE) + r"([a-z0-9-]+)\"")
LISTED = re.compile(r"`" + re.escape(PROBLEM_TYPE_BASE) + r"([a-z0-9-]+)`")


def kinds_in_the_code() -> set[str]:
    found = set()
    for path in SOURCE.rglob("*.py"):
        text = path.read_text()
        found |= set(MADE.findall(text)) | set(WRITTEN.findall(text))
    return found


def kinds_problem_for_answers() -> set[str]:
    """What `problem_for` answers for every error class idempo has, whatever the branch."""
    classes, pending = set(), [IdempotencyError]
    while pending:
        cls = pending.pop()
        classes.add(cls)
        pending.extend(cls.__subclasses__())
    kinds = set()
    for cls in classes:
        error = cls.__new__(cls)
        error.args = ("an example",)
        error.header = "Idempotency-Key"  # what the branches read of their errors
        error.retry_after = 1.0
        kinds.add(json.loads(problem_for(error).body)["type"].removeprefix(PROBLEM_TYPE_BASE))
    return kinds


def test_every_problem_type_the_code_answers_is_on_the_page() -> None:
    listed = set(LISTED.findall(PAGE.read_text()))
    made = kinds_in_the_code()
    assert kinds_problem_for_answers() <= made  # the search above sees every branch
    assert {"missing-key", "not-committed", "response-not-stored", "resolved-by-operator"} <= made
    assert made - listed == set(), "add these to docs/problems.md"
    assert listed - made == set(), "docs/problems.md lists types no code answers"


def test_each_type_has_its_own_row() -> None:
    rows = re.findall(
        r"^\| `" + re.escape(PROBLEM_TYPE_BASE) + r"([a-z0-9-]+)` \|", PAGE.read_text(), re.M
    )
    assert len(rows) == len(set(rows))
    assert set(rows) == kinds_in_the_code()
