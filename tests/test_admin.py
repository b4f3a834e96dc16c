"""The operator side: `idempo.admin` (list, inspect, evict, resolve) on every store, sync and
async, the CLI commands ``list`` and ``resolve`` on real stores, and a resolve that races the
record's live holder (threads) or cuts in on a running HTTP request."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import threading
import time
from datetime import UTC, datetime, timedelta
from inspect import signature as inspect_signature
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from typer.testing import CliRunner

import idempo
import idempo._cli_ops
from idempo import Idempotency, Policy, Scope, Status, cli, fingerprint
from idempo._http.principals import default_principal
from idempo._http.response import decode_response
from idempo.admin import (
    RESOLVED_ERROR,
    RESOLVED_PROBLEM,
    Admin,
    AsyncAdmin,
    LiveLeaseError,
    NoRecordError,
    NotInProgressError,
    http_principal,
    http_scope,
)
from idempo.asgi import IdempotencyMiddleware
from idempo.cli import app
from idempo.errors import ConfigurationError, FencedError, ReplayedFailureError
from idempo.stores import open_store
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore

runner = CliRunner()
LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)


def _now() -> datetime:
    return datetime.now(UTC)


def _reserve(
    store: Any, scope: Scope, *, at: datetime | None = None, lease: timedelta = LEASE
) -> int:
    reservation = store.reserve(scope, "fp", now=at, lease=lease, ttl=TTL)
    return int(reservation.token)


# -- the API on every store --------------------------------------------------------------------


def test_list_finds_stuck_keys_by_every_filter(store: Any) -> None:
    """in_progress_for finds the key reserved ten minutes ago whose holder vanished, not the
    fresh one nor the settled ones; the other filters narrow as asked; no responses travel."""
    now = _now()
    stuck = Scope.of("stuck", operation="POST /payments", principal="alice")
    _reserve(store, stuck, at=now - timedelta(minutes=10))
    _reserve(store, Scope.of("fresh", operation="POST /payments", principal="alice"), at=now)
    done = Scope.of("done", operation="refund", principal="bob")
    store.complete(done, _reserve(store, done, at=now - timedelta(hours=1)), b"ok", now=now,
                   ttl=TTL)  # fmt: skip
    admin = Admin(store)

    found = admin.list_records(in_progress_for=timedelta(minutes=5), now=now)
    assert [r.scope for r in found] == [stuck]
    assert found[0].lease_expires_at is not None
    assert found[0].lease_expires_at < now  # its lease ended: a stuck key
    assert [r.scope.key for r in admin.list_records(status="completed")] == ["done"]
    assert {r.scope.key for r in admin.list_records(principal="alice")} == {"stuck", "fresh"}
    assert [r.scope.key for r in admin.list_records(operation="refund")] == ["done"]
    older = admin.list_records(older_than=timedelta(minutes=30), now=now)
    assert [r.scope.key for r in older] == ["done"]
    assert all(r.response is None for r in admin.list_records())
    assert len(admin.list_records(limit=2)) == 2
    with pytest.raises(ConfigurationError):
        admin.list_records(status="stuck")
    with pytest.raises(ConfigurationError):
        admin.list_records(status="completed", in_progress_for=timedelta(minutes=5))


def test_inspect_by_the_key_as_the_http_app_sees_it(store: Any) -> None:
    """http_scope computes the HTTP default principal from an Authorization value (the SHA-256
    the middleware records) and reads the key as the header carries it."""
    recorded = Scope(default_principal([b"Bearer s3cret"]), "POST /payments", "order-7")
    token = _reserve(store, recorded)
    store.complete(recorded, token, b"201", now=None, ttl=TTL)
    admin = Admin(store)

    asked = http_scope('"order-7"', "POST /payments", authorization="Bearer s3cret")
    record = admin.inspect(asked)
    assert record is not None
    assert (record.scope, record.status, record.response) == (recorded, Status.COMPLETED, b"201")
    assert admin.inspect(http_scope("order-7", "POST /payments", authorization="Bearer x")) is None
    assert http_principal() == ""
    assert http_principal(principal="user:7") == "user:7"
    assert http_principal(principal="user:" + "é" * 300).startswith("sha256:")
    with pytest.raises(ConfigurationError):
        http_principal(principal="user:7", authorization="Bearer s3cret")


def test_evict_refuses_a_live_lease_unless_forced(store: Any) -> None:
    """A live holder's record stays (LiveLeaseError) unless forced; one whose lease ended, or
    a settled one, is deleted; a missing one answers False."""
    admin = Admin(store)
    live = Scope.of("live", operation="charge")
    _reserve(store, live)
    with pytest.raises(LiveLeaseError) as refused:
        admin.evict(live)
    assert "live lease" in str(refused.value)
    assert store.get(live) is not None
    assert admin.evict(live, force=True) is True
    assert store.get(live) is None

    lapsed = Scope.of("lapsed", operation="charge")
    _reserve(store, lapsed, at=_now() - timedelta(minutes=5))
    assert admin.evict(lapsed) is True
    assert store.get(lapsed) is None

    settled = Scope.of("settled", operation="charge")
    store.complete(settled, _reserve(store, settled), b"ok", now=None, ttl=TTL)
    assert admin.evict(settled) is True
    assert admin.evict(settled) is False


def test_resolve_fails_the_record_and_fences_its_holder(store: Any) -> None:
    """resolve refuses a live lease without force; with it, the record is FAILED under the
    holder's token, the holder cannot complete over it, and a retry through the function API
    replays the operator's reason."""
    scope = Scope.of("pay-1", operation="charge", principal="alice")
    token = store.reserve(scope, fingerprint(b""), now=None, lease=LEASE, ttl=TTL).token
    admin = Admin(store)
    with pytest.raises(LiveLeaseError):
        admin.resolve(scope, "stuck since the outage")
    record = admin.resolve(scope, "stuck since the outage", force=True)
    assert (record.status, record.token) == (Status.FAILED, token)
    with pytest.raises(FencedError):
        store.complete(scope, token, b"late", now=None, ttl=TTL)

    retry = Idempotency(store, Policy()).once("pay-1", operation="charge", principal="alice")
    with pytest.raises(ReplayedFailureError) as replayed, retry:
        pytest.fail("the retry ran the work again")
    assert (replayed.value.error_type, replayed.value.detail) == (
        RESOLVED_ERROR,
        "stuck since the outage",
    )
    with pytest.raises(NotInProgressError):
        admin.resolve(scope, "again", force=True)
    with pytest.raises(NoRecordError):
        admin.resolve(Scope.of("never", operation="charge"), "gone")
    with pytest.raises(ConfigurationError):
        admin.resolve(scope, "   ")


def test_resolve_stores_a_problem_response_for_an_http_operation(store: Any) -> None:
    """For an operation shaped as HTTP names them, the FAILED answer is a stored problem
    response (500 by default) with the operator's reason, as the middleware would replay it."""
    scope = Scope("", "POST /payments", "k-http")
    _reserve(store, scope, at=_now() - timedelta(minutes=5))
    record = Admin(store).resolve(scope, "the PSP never answered", http_status=502)
    assert record.response is not None
    response = decode_response(record.response)
    assert response.status == 502
    body = json.loads(response.body)
    assert body["type"] == RESOLVED_PROBLEM
    assert body["detail"] == "the PSP never answered"


def test_resolve_races_a_live_holder_and_exactly_one_wins(node_store: Any) -> None:
    """The holder's completion and an operator's forced resolve, released together from two
    threads, 12 times: each time exactly one lands, the other is refused, and the record
    holds the winner's outcome."""
    admin = Admin(node_store)
    wins = {"holder": 0, "operator": 0}
    for n in range(12):
        scope = Scope.of(f"race-{n}", operation="charge")
        token = _reserve(node_store, scope)
        barrier = threading.Barrier(2)
        outcome: dict[str, str] = {}

        def holder(scope: Scope = scope, token: int = token, barrier: Any = barrier,
                   outcome: dict[str, str] = outcome) -> None:  # fmt: skip
            barrier.wait()
            try:
                node_store.complete(scope, token, b"charged", now=None, ttl=TTL)
                outcome["holder"] = "won"
            except FencedError:
                outcome["holder"] = "refused"

        def operator(scope: Scope = scope, barrier: Any = barrier,
                     outcome: dict[str, str] = outcome) -> None:  # fmt: skip
            barrier.wait()
            try:
                admin.resolve(scope, "operator", force=True)
                outcome["operator"] = "won"
            except (FencedError, NotInProgressError):
                outcome["operator"] = "refused"

        threads = [threading.Thread(target=holder), threading.Thread(target=operator)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert sorted(outcome.values()) == ["refused", "won"], outcome
        winner = next(who for who, what in outcome.items() if what == "won")
        wins[winner] += 1
        record = node_store.get(scope)
        assert record is not None
        assert record.token == token
        if winner == "holder":
            assert (record.status, record.response) == (Status.COMPLETED, b"charged")
        else:
            assert record.status is Status.FAILED
    assert sum(wins.values()) == 12


def test_evict_never_deletes_a_takeover_it_races(node_store: Any) -> None:
    """An operator evicts a lapsed key while its retry takes it over, released together from
    two threads, 12 times: the eviction is fenced on the lapsed token, so whichever goes
    first, the retry's reservation is what remains (or the eviction is refused)."""
    admin = Admin(node_store)
    for n in range(12):
        scope = Scope.of(f"lapsed-{n}", operation="charge")
        _reserve(node_store, scope, at=_now() - timedelta(minutes=10))
        barrier = threading.Barrier(2)
        outcome: dict[str, Any] = {}

        def retry(scope: Scope = scope, barrier: Any = barrier,
                  outcome: dict[str, Any] = outcome) -> None:  # fmt: skip
            barrier.wait()
            outcome["retry"] = node_store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL)

        def evict(scope: Scope = scope, barrier: Any = barrier,
                  outcome: dict[str, Any] = outcome) -> None:  # fmt: skip
            barrier.wait()
            try:
                outcome["evict"] = admin.evict(scope)
            except LiveLeaseError:
                outcome["evict"] = "refused"

        threads = [threading.Thread(target=retry), threading.Thread(target=evict)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert outcome["evict"] in (True, "refused"), outcome
        record = node_store.get(scope)
        assert record is not None, f"the retry's reservation was evicted ({outcome})"
        assert (record.status, record.token) == (Status.IN_PROGRESS, outcome["retry"].token)


@pytest.mark.anyio
async def test_the_async_face_does_the_same(async_node_store: Any) -> None:
    """AsyncAdmin lists, inspects, resolves and evicts on the async stores."""
    admin = AsyncAdmin(async_node_store)
    now = _now()
    scope = Scope.of("a-1", operation="charge")
    reservation = await async_node_store.reserve(
        scope, "fp", now=now - timedelta(minutes=10), lease=LEASE, ttl=TTL
    )
    found = await admin.list_records(in_progress_for=timedelta(minutes=5), now=now)
    assert [r.scope for r in found] == [scope]
    record = await admin.resolve(scope, "stuck")
    assert (record.status, record.token) == (Status.FAILED, reservation.token)
    inspected = await admin.inspect(scope)
    assert inspected == record
    assert await admin.evict(scope) is True
    assert await admin.inspect(scope) is None


def test_a_store_without_a_scan_verb_cannot_list() -> None:
    """Listing a store that lacks the optional verb is a ConfigurationError naming it."""

    class Bare:
        def get(self, scope: Scope) -> None:
            return None

    with pytest.raises(ConfigurationError, match="no scan verb"):
        Admin(Bare()).list_records()  # type: ignore[arg-type]


# -- the CLI ---------------------------------------------------------------------------------


def _sqlite(tmp_path: Path) -> tuple[str, SQLiteStore]:
    path = tmp_path / "ops.db"
    store = SQLiteStore(str(path))
    store.migrate()
    return f"sqlite:///{path}", store


def test_cli_list_and_resolve_with_json(tmp_path: Path) -> None:
    """list --json prints the records as JSON; resolve --authorization ends the stuck one
    under the principal the HTTP middleware computes; exit codes say what happened."""
    url, store = _sqlite(tmp_path)
    stuck = Scope(default_principal([b"Bearer tok"]), "POST /payments", "k-stuck")
    _reserve(store, stuck, at=_now() - timedelta(minutes=10))
    live = Scope.of("k-live", operation="charge", principal="bob")
    _reserve(store, live)
    store.close()

    listed = runner.invoke(app, ["list", url, "--in-progress-for", "5m", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    assert [(r["key"], r["status"], r["lease"]) for r in rows] == [
        ("k-stuck", "in_progress", "expired")
    ]
    assert rows[0]["principal"] == stuck.principal
    table = runner.invoke(app, ["list", url, "--status", "in_progress"])
    assert table.exit_code == 0, table.output
    assert "k-stuck" in table.output
    assert "k-live" in table.output

    resolved = runner.invoke(app, ["resolve", url, "k-stuck", "--operation", "POST /payments",
                                   "--authorization", "Bearer tok", "--fail", "PSP outage",
                                   "--json"])  # fmt: skip
    assert resolved.exit_code == 0, resolved.output
    data = json.loads(resolved.output)
    assert data["status"] == "failed"
    assert json.loads(data["response_text"].split("\n", 1)[1])["detail"] == "PSP outage"

    refused = runner.invoke(app, ["resolve", url, "k-live", "--operation", "charge",
                                  "--principal", "bob", "--fail", "no"])  # fmt: skip
    assert refused.exit_code == 4
    assert "live lease" in refused.output
    assert "Traceback" not in refused.output
    forced = runner.invoke(app, ["resolve", url, "k-live", "--operation", "charge",
                                 "--principal", "bob", "--fail", "no", "--force"])  # fmt: skip
    assert forced.exit_code == 0, forced.output
    settled = runner.invoke(app, ["resolve", url, "k-live", "--operation", "charge",
                                  "--principal", "bob", "--fail", "no", "--force"])  # fmt: skip
    assert settled.exit_code == 4
    assert "failed already" in settled.output
    missing = runner.invoke(app, ["resolve", url, "nope", "--operation", "charge", "--fail", "x"])
    assert missing.exit_code == 1
    assert "no record" in missing.output


def test_cli_errors_are_one_line_and_read_only_commands_create_nothing(tmp_path: Path) -> None:
    """A bad duration or status is bad input (2); a missing SQLite file is the store's failure
    (3) and stays missing; an unmigrated PostgreSQL-less path too; each one line."""
    absent = tmp_path / "absent.db"
    for args, code in (
        (["list", f"sqlite:///{absent}"], 3),
        (["list", f"sqlite:///{absent}", "--older-than", "soon"], 2),
        (["resolve", f"sqlite:///{absent}", "k", "--operation", "x", "--fail", "r"], 3),
        (["list", "memory://", "--status", "stuck"], 2),
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == code, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert result.output.startswith("error:"), result.output
    assert not absent.exists()


def test_cli_unreachable_server_fails_fast_with_the_cause() -> None:
    """A server that refuses connections: one line naming the cause, exit 3, within the
    connect timeout."""
    started = time.monotonic()
    result = runner.invoke(
        app, ["list", "postgresql://postgres@127.0.0.1:1/test?connect_timeout=2"]
    )
    elapsed = time.monotonic() - started
    assert result.exit_code == 3, result.output
    assert "refused" in result.output.lower(), result.output
    assert len(result.output.strip().splitlines()) == 1
    assert elapsed < 6


@pytest.mark.postgres
def test_cli_list_and_resolve_on_postgresql(postgres_url: str, pg_schema: str) -> None:
    """The same commands against the real PostgreSQL server."""
    url = f"{postgres_url}?table={pg_schema}.idempo_records"
    store = open_store(url)
    store.migrate()  # type: ignore[attr-defined]
    scope = Scope.of("pg-stuck", operation="charge")
    _reserve(store, scope, at=_now() - timedelta(minutes=10))
    store.close()
    listed = runner.invoke(app, ["list", url, "--in-progress-for", "5m", "--json"])
    assert listed.exit_code == 0, listed.output
    assert [r["key"] for r in json.loads(listed.output)] == ["pg-stuck"]
    resolved = runner.invoke(app, ["resolve", url, "pg-stuck", "--operation", "charge",
                                   "--fail", "gone"])  # fmt: skip
    assert resolved.exit_code == 0, resolved.output
    assert "resolved" in resolved.output
    store = open_store(url)
    record = store.get(scope)
    store.close()
    assert record is not None
    assert record.status is Status.FAILED


# -- through a real HTTP app -------------------------------------------------------------------


@pytest.mark.anyio
async def test_resolve_cuts_in_on_a_running_http_request(tmp_path: Path) -> None:
    """A request is running (its handler waits); the operator finds it by the caller's
    Authorization and resolves it with --force; the handler then finishes, but its answer is
    fenced out, and the client's retry gets the operator's problem document."""
    path = tmp_path / "http.db"
    _migrated = SQLiteStore(str(path))
    _migrated.migrate()
    _migrated.close()
    store = AsyncSQLiteStore(str(path))
    started, release = asyncio.Event(), asyncio.Event()
    ran = 0

    async def pay(request: Request) -> JSONResponse:
        nonlocal ran
        ran += 1
        started.set()
        await release.wait()
        return JSONResponse({"paid": True}, status_code=201)

    web = Starlette(routes=[Route("/payments", pay, methods=["POST"])])
    guarded = IdempotencyMiddleware(web, store=store)
    transport = httpx.ASGITransport(app=guarded)
    headers = {"Idempotency-Key": "order-9", "Authorization": "Bearer alice-token"}
    url = f"sqlite:///{path}"
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            first = asyncio.create_task(client.post("/payments", json={"n": 1}, headers=headers))
            await asyncio.wait_for(started.wait(), 10)
            listed = await asyncio.to_thread(
                runner.invoke, app, ["list", url, "--status", "in_progress", "--json"]
            )
            assert [r["key"] for r in json.loads(listed.output)] == ["order-9"]
            resolved = await asyncio.to_thread(
                runner.invoke,
                app,
                ["resolve", url, "order-9", "--operation", "POST /payments", "--authorization",
                 "Bearer alice-token", "--fail", "cancelled by support", "--force"],
            )  # fmt: skip
            assert resolved.exit_code == 0, resolved.output
            release.set()
            await asyncio.wait_for(first, 10)
            retry = await client.post("/payments", json={"n": 1}, headers=headers)
    finally:
        await store.aclose()
    assert ran == 1
    assert retry.status_code == 500
    assert retry.headers["content-type"] == "application/problem+json"
    assert retry.json()["type"] == RESOLVED_PROBLEM
    assert retry.json()["detail"] == "cancelled by support"


# -- docs/operations.md runs as written --------------------------------------------------------

OPERATIONS = Path(__file__).parent.parent / "docs" / "operations.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def test_the_operations_page_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every python block of docs/operations.md runs, in order, each as a program of its own
    in a directory of its own; every ``$ idempo`` line of its console blocks (continuations of
    the first program) runs through the CLI after it, in its directory, and exits 0."""
    blocks = FENCE.findall(OPERATIONS.read_text())
    programs = [code for lang, code in blocks if lang == "python"]
    commands = [
        line.removeprefix("$ ")
        for lang, code in blocks
        if lang == "console"
        for line in code.splitlines()
        if line.startswith("$ idempo ")
    ]
    assert len(programs) >= 4
    assert len(commands) >= 6
    for n, program in enumerate(programs):
        here = tmp_path / f"block-{n}"
        here.mkdir()
        monkeypatch.chdir(here)
        exec(compile(program, f"operations.md block {n}", "exec"), {"__name__": "__main__"})
        if n == 0:
            for command in commands:
                result = runner.invoke(app, shlex.split(command)[1:])
                assert result.exit_code == 0, (command, result.output)
    printed = capsys.readouterr().out
    assert "expired" in printed
    assert "the holder's completion was refused" in printed


# -- the existing commands with the operator options (the cli.py patch) ----------------------

_PATCHED = "force" in inspect_signature(cli.evict).parameters
needs_patch = pytest.mark.skipif(not _PATCHED, reason="cli.py lacks the operator options yet")


@needs_patch
def test_version_and_json_on_migrate_stats_and_purge(tmp_path: Path) -> None:
    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0
    assert version.output.strip() == f"idempo {idempo.__version__}"
    url = f"sqlite:///{tmp_path / 'json.db'}"
    migrated = runner.invoke(app, ["migrate", url, "--json"])
    assert migrated.exit_code == 0, migrated.output
    assert json.loads(migrated.output)["table"] == "idempo_records"
    store = open_store(url)
    scope = Scope.of("k", operation="charge")
    past, tick = _now() - timedelta(hours=1), timedelta(microseconds=1)
    token = store.reserve(scope, "fp", now=past, lease=tick, ttl=tick).token
    store.complete(scope, token, b"ok", now=past, ttl=tick)
    store.close()
    stats = runner.invoke(app, ["stats", url, "--json"])
    assert json.loads(stats.output)["records"] == {"in_progress": 0, "completed": 1, "failed": 0}
    purged = runner.invoke(app, ["purge", url, "--json"])
    assert purged.exit_code == 0, purged.output
    assert json.loads(purged.output)["records"] == 1


@needs_patch
def test_evict_refuses_a_live_lease_and_inspect_takes_an_authorization(tmp_path: Path) -> None:
    url, store = _sqlite(tmp_path)
    scope = Scope(default_principal([b"Bearer tok"]), "POST /payments", "k-live")
    _reserve(store, scope)
    store.close()
    shown = runner.invoke(app, ["inspect", url, "k-live", "--operation", "POST /payments",
                                "--authorization", "Bearer tok", "--json"])  # fmt: skip
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["lease"] == "live"
    args = ["evict", url, "k-live", "--operation", "POST /payments", "--authorization",
            "Bearer tok"]  # fmt: skip
    refused = runner.invoke(app, args)
    assert refused.exit_code == 4
    assert "live lease" in refused.output
    assert len(refused.output.strip().splitlines()) == 1
    forced = runner.invoke(app, [*args, "--force", "--json"])
    assert forced.exit_code == 0, forced.output
    assert json.loads(forced.output)["evicted"] is True
    again = runner.invoke(app, [*args, "--json"])
    assert again.exit_code == 1
    assert json.loads(again.output)["evicted"] is False
    missing = runner.invoke(app, ["inspect", url, "k-live", "--operation", "x", "--json"])
    assert (missing.exit_code, missing.output.strip()) == (1, "null")
