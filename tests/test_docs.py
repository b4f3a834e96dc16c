"""Every code block of README.md and docs/*.md runs as written (issue 13).

The conventions a page follows (docs/README.md, "About the examples", says them for readers):

* A ```python block is a **complete program**. It runs in a fresh temporary directory (its
  SQLite files land there), in a namespace of its own, as ``__main__``.
* A block whose first line is ``# continues the block above`` runs in the namespace and the
  directory of the block before it on the page (which must be a program or a continuation).
  A ```sh or ```console block may continue a program too: its commands then run in the
  program's directory, after it (a program makes a SQLite file, the commands look at it).
* A block whose first line is ``# fragment: <what it is a fragment of>`` is only compiled (as
  the body of an ``async def``, so ``await`` and ``return`` may appear). A fragment
  ``of src/...`` or ``of tests/...`` quotes that file: its lines are in it, to the letter.
* A block whose first line is ``# <name>.py`` is a file the page shows: it is saved under that
  name in the page's directory, where the page's programs import it, and compiled.
* ```sh and ```console blocks run when every command in them is an ``idempo`` invocation
  (``$ `` starts a command in a console block; the other lines are its output): each command
  through typer's runner, in a fresh directory (or the program's, continuing one), and it
  must exit 0. Any other command (``pip install``, ``make``, a server, a long test run) is not
  run, and the test skips the block saying why.
* Other blocks (toml, mermaid, sql, promql, plain text) are not run; the tests that check them
  (test_extending_docs.py for the toml, the payments table below for the sql) say so.

Two checks span the pages: the example ``payments`` table has one shape everywhere
(``PAYMENTS``), and every program that opens a SQL store migrates it (a first run must not
answer 503 because no page said to migrate).

Services: a block reaches PostgreSQL, MariaDB and Redis at the URLs the tests use
(``postgresql://postgres@127.0.0.1:5432/test``, ``mysql://root@127.0.0.1:3306/test``,
``redis://127.0.0.1:6379/0``, as the page shows them). This test hands each program a fresh
PostgreSQL schema (the URL's ``search_path``), a fresh MariaDB database and a fresh Redis key
prefix in their place, taken from IDEMPO_TEST_POSTGRES_URL, IDEMPO_TEST_MYSQL_URL and
IDEMPO_TEST_REDIS_URL as in conftest.py, and drops them afterwards: so the pages' ``payments``
tables never meet the rest of the suite's. Programs that talk to a broker (RabbitMQ, NATS,
Redis Streams) under the names a page shows take a lock file first, so two test runs on one
machine take turns.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shlex
import sqlite3
import sys
import tempfile
import textwrap
import tomllib
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
import pymysql
import pytest
import redis
from typer.testing import CliRunner

from idempo import cli
from idempo.stores import _registry
from idempo.stores.mysql import connect_options

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(`{3,})([\w+-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)

POSTGRES_URL = os.environ.get(
    "IDEMPO_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
MYSQL_URL = os.environ.get("IDEMPO_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("IDEMPO_TEST_REDIS_URL", "redis://127.0.0.1:6379/1")

# The URLs as the pages show them: `postgresql+psycopg://...` keeps its driver.
SHOWN_POSTGRES = re.compile(r"postgresql(\+\w+)?://postgres@127\.0\.0\.1:5432/test(\?[^\s\"')]*)?")
SHOWN_MYSQL = re.compile(r"(mysql|mariadb)(\+\w+)?://root@127\.0\.0\.1:3306/test(\?[^\s\"')]*)?")
SHOWN_REDIS = re.compile(r"redis://127\.0\.0\.1:6379/0(\?[^\s\"')]*)?")
BROKERS = re.compile(r"amqp://|nats://|RedisBroker\(")

CONTINUES = "# continues the block above"
FRAGMENT = re.compile(r"# fragment(?::| of) ?(.*)")
FILE = re.compile(r"# ([\w/]+\.py)$")

# Commands a shell block may show that this test does not run, and why.
NOT_RUN = {
    "pip": "installs packages",
    "make": "builds .venv and runs the whole suite (make test runs this test)",
    ".venv/bin/python": "is a longer run of one of the suite's tests, with larger bounds",
    "pytest": "runs pytest on a page's files (the suite runs those: test_extending_docs.py)",
    "python": "runs a Python program, not an idempo command",
    "curl": "sends requests to a server started in the block",
}
SERVES = ("--serve",)


@dataclass
class Block:
    page: str
    number: int  # 1-based, among the page's fenced blocks
    line: int
    language: str
    code: str

    @property
    def first(self) -> str:
        return self.code.partition("\n")[0].strip()

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    page = str(path.relative_to(ROOT))
    return [
        Block(page, n, text.count("\n", 0, m.start()) + 1, m.group(2), m.group(3))
        for n, m in enumerate(FENCE.finditer(text), 1)
    ]


def kind(block: Block) -> str:
    if block.language == "python":
        if block.first == CONTINUES:
            return "continuation"
        if FRAGMENT.fullmatch(block.first):
            return "fragment"
        if FILE.fullmatch(block.first):
            return "file"
        return "program"
    if block.language in ("sh", "console", "bash", "shell"):
        return "continuation" if block.first == CONTINUES else "shell"
    return "text"


@dataclass
class Program:
    """A program and its continuations: what runs in one namespace."""

    page: str
    parts: list[Block] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.parts[0].name


def programs(path: Path) -> tuple[list[Block], list[Program]]:
    """The page's files and its programs, in page order."""
    files, runs = [], []
    for block in blocks(path):
        what = kind(block)
        if what == "file":
            files.append(block)
        elif what == "program":
            runs.append(Program(block.page, [block]))
        elif what == "continuation":
            assert runs, f"{block.name} continues a block, but none runs before it"
            runs[-1].parts.append(block)
    return files, runs


def _every(what: str) -> list[pytest.param]:
    found = []
    for path in PAGES:
        for block in blocks(path):
            if kind(block) == what:
                marks = _marks(Program(block.page, [block])) if what == "shell" else []
                found.append(pytest.param(block, id=block.name, marks=marks))
    return found


def _programs() -> list[pytest.param]:
    return [
        pytest.param(path, run, id=run.name, marks=_marks(run))
        for path in PAGES
        for run in programs(path)[1]
    ]


def _marks(run: Program) -> list[pytest.MarkDecorator]:
    code = "\n".join(part.code for part in run.parts)
    marks = []
    for pattern, mark in (
        (SHOWN_POSTGRES, pytest.mark.postgres),
        (SHOWN_MYSQL, pytest.mark.mysql),
        (SHOWN_REDIS, pytest.mark.redis),
        (re.compile("amqp://"), pytest.mark.rabbitmq),
        (re.compile("nats://"), pytest.mark.nats),
    ):
        if pattern.search(code):
            marks.append(mark)
    return marks


# --- the services each program gets -------------------------------------------------------


def _with_query(url: str, extra: dict[str, str]) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.update(extra)
    return urlunsplit(parts._replace(query=urlencode(query)))


@dataclass
class Services:
    """Fresh places on the real servers for one program, and the code as it will run."""

    token: str = field(default_factory=lambda: secrets.token_hex(4))
    schema: str | None = None
    database: str | None = None
    prefix: str | None = None

    def postgres(self, match: re.Match[str]) -> str:
        if self.schema is None:
            self.schema = f"docs_{self.token}"
            with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
                conn.execute(f"CREATE SCHEMA {self.schema}")
        base = POSTGRES_URL.replace("postgresql://", f"postgresql{match.group(1) or ''}://", 1)
        shown = dict(parse_qsl((match.group(2) or "?")[1:]))
        return _with_query(base, {**shown, "options": f"-csearch_path={self.schema}"})

    def mysql(self, match: re.Match[str]) -> str:
        if self.database is None:
            self.database = f"docs_{self.token}"
            with pymysql.connect(**connect_options(MYSQL_URL), autocommit=True) as conn:
                conn.cursor().execute(f"CREATE DATABASE {self.database}")
        parts = urlsplit(MYSQL_URL)
        scheme = f"{match.group(1)}{match.group(2) or ''}"
        url = urlunsplit(parts._replace(scheme=scheme, path=f"/{self.database}"))
        shown = dict(parse_qsl((match.group(3) or "?")[1:]))
        return _with_query(url, shown) if shown else url

    def redis(self, match: re.Match[str]) -> str:
        self.prefix = self.prefix or f"docs-{self.token}"
        shown = dict(parse_qsl((match.group(1) or "?")[1:]))
        return _with_query(REDIS_URL, {**shown, "prefix": self.prefix})

    def rewrite(self, code: str) -> str:
        code = SHOWN_POSTGRES.sub(self.postgres, code)
        code = SHOWN_MYSQL.sub(self.mysql, code)
        return SHOWN_REDIS.sub(self.redis, code)

    def drop(self) -> None:
        if self.schema:
            with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA {self.schema} CASCADE")
        if self.database:
            with pymysql.connect(**connect_options(MYSQL_URL), autocommit=True) as conn:
                conn.cursor().execute(f"DROP DATABASE {self.database}")
        if self.prefix:
            with redis.Redis.from_url(REDIS_URL) as client:
                keys = list(client.scan_iter(match=f"{self.prefix}*", count=1000))
                for start in range(0, len(keys), 500):
                    client.delete(*keys[start : start + 500])


@contextmanager
def _services() -> Iterator[Services]:
    services = Services()
    try:
        yield services
    finally:
        services.drop()


@contextmanager
def _brokers_to_ourselves(code: str) -> Iterator[None]:
    """The pages name their queues and streams (``payments``, ``orders``) as a reader would:
    two runs of this test on one machine take turns at them."""
    if not BROKERS.search(code):
        yield
        return
    with open(Path(tempfile.gettempdir()) / "idempo-docs-brokers.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def _page_directory(path: Path, files: list[Block]) -> Iterator[Path]:
    """A fresh directory holding the page's files, importable, the current directory while
    the program runs; what it imported from there is forgotten afterwards."""
    here = os.getcwd()
    registered = dict(_registry._registered)
    modules = set(sys.modules)
    with tempfile.TemporaryDirectory(prefix="idempo-docs-") as directory:
        for block in files:
            name = FILE.fullmatch(block.first).group(1)  # type: ignore[union-attr]
            target = Path(directory, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code.partition("\n")[2])
        sys.path.insert(0, directory)
        os.chdir(directory)
        try:
            yield Path(directory)
        finally:
            os.chdir(here)
            sys.path.remove(directory)
            _registry._registered.clear()
            _registry._registered.update(registered)
            for name in set(sys.modules) - modules:
                origin = getattr(sys.modules[name], "__file__", None) or ""
                if origin.startswith(directory):
                    del sys.modules[name]


@contextmanager
def _as_main() -> Iterator[dict[str, object]]:
    """A fresh ``__main__`` module, as ``python program.py`` makes: libraries that look a
    class's module up in sys.modules (SQLAlchemy's annotations, dataclasses) find it."""
    main = types.ModuleType("__main__")
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        yield main.__dict__
    finally:
        sys.modules["__main__"] = saved


def _servers_answer(request: pytest.FixtureRequest) -> None:
    """The servers the block needs answer (conftest.py's fixtures skip locally, fail under
    IDEMPO_TEST_REQUIRE_ALL), so a missing one is said as such, not as the block's error."""
    for mark, fixture in (
        ("postgres", "postgres_url"),
        ("mysql", "mysql_url"),
        ("redis", "redis_url"),
    ):
        if request.node.get_closest_marker(mark):
            request.getfixturevalue(fixture)


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "run"), _programs())
def test_program_runs_as_written(path: Path, run: Program, request: pytest.FixtureRequest) -> None:
    _servers_answer(request)
    files, _ = programs(path)
    code = "\n".join(part.code for part in run.parts)
    with (
        _services() as services,
        _brokers_to_ourselves(code),
        _page_directory(path, files),
        _as_main() as namespace,
    ):
        for part in run.parts:
            if kind(part) == "continuation" and part.language != "python":
                _run_commands(part, services, Path.cwd())
                continue
            # Saved as a file, as a reader would run it, so that `inspect` finds the source
            # (FastStream reads a handler's); its line numbers are the page's own.
            script = Path(f"{Path(part.page).stem}-line-{part.line}.py").resolve()
            script.write_text("\n" * part.line + services.rewrite(part.code))
            try:
                exec(compile(script.read_text(), str(script), "exec"), namespace)  # the page's
            except BaseException as exc:
                exc.add_note(f"in the block at {part.name} (saved as {script.name})")
                raise


@pytest.mark.parametrize("block", _every("fragment") + _every("file"))
def test_fragment_compiles(block: Block) -> None:
    if kind(block) == "file":
        compile(block.code, block.name, "exec")
        return
    body = block.code.partition("\n")[2]
    wrapped = "async def __fragment__():\n" + textwrap.indent(textwrap.dedent(body), "    ")
    compile(wrapped + "\n    pass\n", block.name, "exec")
    what = FRAGMENT.fullmatch(block.first)
    quoted = what and re.match(r"((?:src|tests)/[\w/.]+\.py)", what.group(1))
    if quoted:
        source = (ROOT / quoted.group(1)).read_text()
        assert body in source, f"{block.name} does not quote {quoted.group(1)} as it is"


def _commands(block: Block) -> list[str]:
    lines = block.code.splitlines()
    if block.language == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    commands = []
    for line in lines:
        command = re.sub(r"(^|\s)#.*$", "", line).strip()
        if command:
            commands.append(command)
    return commands


def _why_not(command: str) -> str | None:
    first = shlex.split(command)[0] if command else ""
    if first == "idempo" and not any(flag in command.split() for flag in SERVES):
        if command.endswith("&"):
            return "starts a server in the background"
        return None
    if first == "idempo":
        return "serves until it is stopped"
    for prefix, why in NOT_RUN.items():
        if first == prefix or first.startswith(prefix + " "):
            return why
    if "=" in first:  # VAR=value command ...
        return _why_not(command.split(None, 1)[1])
    return "runs other shell commands than idempo's"


@pytest.mark.parametrize("block", _every("shell"))
def test_shell_block_runs_as_written(block: Block, request: pytest.FixtureRequest) -> None:
    _servers_answer(request)
    commands = _commands(block)
    reasons = sorted({why for why in map(_why_not, commands) if why})
    if reasons:
        pytest.skip(f"{block.name} not run: it {'; '.join(reasons)}")
    with _services() as services, tempfile.TemporaryDirectory(prefix="idempo-docs-") as here:
        _run_commands(block, services, Path(here))


def _run_commands(block: Block, services: Services, here: Path) -> None:
    """Each command of the block, as the ``idempo`` command runs it (typer's runner, in this
    process: a subprocess would import idempo again for every line), in ``here``; each must
    exit 0."""
    commands = _commands(block)
    assert commands, f"{block.name} shows no command"
    before = os.getcwd()
    os.chdir(here)
    try:
        for command in commands:
            why = _why_not(command)
            assert why is None, f"{block.name}: {command!r} cannot run here: it {why}"
            argv = shlex.split(services.rewrite(command))
            done = CliRunner().invoke(cli.app, argv[1:], prog_name="idempo", catch_exceptions=False)
            assert done.exit_code == 0, f"{block.name}: {command}\n{done.output}"
    finally:
        os.chdir(before)


def test_every_block_is_accounted_for() -> None:
    """Every fenced block is run, compiled, or named here as not code, and none escapes the
    search (an indented fence, one left open)."""
    for path in PAGES:
        text = path.read_text()
        assert not re.search(r"^[ \t]+```", text, re.MULTILINE), f"{path.name}: an indented fence"
        fences = len(re.findall(r"^```", text, re.MULTILINE))
        assert fences == 2 * len(blocks(path)), f"{path.name}: a fence this test does not pair"
        for block in blocks(path):
            assert kind(block) in {"program", "continuation", "fragment", "file", "shell", "text"}
            if kind(block) == "text":
                assert block.language in {
                    "",
                    "text",
                    "toml",
                    "mermaid",
                    "json",
                    "http",
                    "sql",
                    "promql",
                }, f"{block.name}: a ```{block.language} block; say here how it is checked"


def test_the_adapter_the_extending_page_quotes_is_as_short_as_it_says() -> None:
    """docs/extending.md quotes idempo.contrib.aiohttp step by step (the fragments above check
    each quote) and calls it "the whole adapter ... in about 150 lines"."""
    page = (ROOT / "docs" / "extending.md").read_text()
    quotes = page.count("# fragment of src/idempo/contrib/aiohttp.py")
    assert quotes >= 4
    assert "in about 150 lines" in page
    assert len((ROOT / "src/idempo/contrib/aiohttp.py").read_text().splitlines()) <= 160


PAYMENTS = (
    "CREATE TABLE IF NOT EXISTS payments"
    " (order_id VARCHAR(64) PRIMARY KEY, amount INTEGER NOT NULL)"
)
SQL_STORE = re.compile(
    r"(open_(async_)?store|IdempotencyWSGIMiddleware|IdempotencyMiddleware|Relay)\(.*"
    r"(sqlite|postgresql|mysql|mariadb)|(SQLite|Postgres|MySQL)Store\("
)


def _joined(code: str) -> str:
    """``code`` with Python's adjacent string literals joined, as the SQL reaches the driver."""
    return re.sub(r"\"\s*\n\s*\"", "", code)


def test_every_page_shows_the_one_payments_table() -> None:
    """The example business table has one shape on every page (docs/README.md shows it), and
    it runs on SQLite, PostgreSQL and MariaDB alike."""
    shapes = {}
    for path in PAGES:
        for block in blocks(path):
            for found in re.finditer(
                r"CREATE TABLE[^(\"]*payments\b\s*\((?:[^()]|\([^()]*\))*\)", _joined(block.code)
            ):
                shapes[block.name] = found.group(0)
    assert shapes
    assert {name: shape for name, shape in shapes.items() if shape != PAYMENTS} == {}


@pytest.mark.postgres
@pytest.mark.mysql
def test_the_payments_table_is_valid_sql_everywhere(postgres_url: str, mysql_url: str) -> None:
    """The ```sql block of docs/README.md is that table, and each database takes it."""
    (shown,) = [b.code.strip() for b in blocks(ROOT / "docs" / "README.md") if b.language == "sql"]
    assert shown == PAYMENTS
    sqlite3.connect(":memory:").execute(shown)
    with _services() as services:
        services.rewrite(
            "postgresql://postgres@127.0.0.1:5432/test mysql://root@127.0.0.1:3306/test"
        )
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"SET search_path TO {services.schema}")
            conn.execute(shown)
        with pymysql.connect(**connect_options(MYSQL_URL), autocommit=True) as conn:
            conn.select_db(services.database)
            conn.cursor().execute(shown)


def test_every_program_that_opens_a_sql_store_migrates_it() -> None:
    """A first run must not answer 503 because no page said to migrate (issue 13): a program
    that opens a SQL store shows ``migrate`` (``store.migrate()`` or ``idempo migrate URL``)."""
    missing = []
    for path in PAGES:
        for run in programs(path)[1]:
            code = "\n".join(part.code for part in run.parts)
            if SQL_STORE.search(code) and "migrate" not in code:
                missing.append(run.name)
    assert missing == []


def test_the_installation_table_names_every_extra() -> None:
    """README's Installation section has a row for each extra pyproject.toml declares (a new
    extra needs its row: what it brings, what for)."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n## Installation\n")
    section = readme[start : readme.index("\n## ", start + 1)]
    rows = set(re.findall(r"^\| `([\w-]+)` \|", section, re.MULTILINE))
    with (ROOT / "pyproject.toml").open("rb") as project:
        extras = set(tomllib.load(project)["project"]["optional-dependencies"])
    assert rows == extras
