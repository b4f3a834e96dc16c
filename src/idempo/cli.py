"""The ``idempo`` command: demo, migrate, purge, inspect, stats."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ._keys import Scope
from .errors import IdempotencyError
from .stores import open_store

app = typer.Typer(help="idempo: make retries safe.", no_args_is_help=True, add_completion=False)
console = Console()

StoreUrl = Annotated[str, typer.Argument(help="store URL, e.g. sqlite:///app.db or postgresql://…")]


@contextmanager
def _store(url: str) -> Iterator[Any]:
    try:
        store = open_store(url)
    except IdempotencyError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    try:
        yield store
    finally:
        store.close()  # a pool left to the garbage collector complains from its threads


@app.command()
def demo(
    store: Annotated[
        str | None, typer.Option(help="store URL (default: a fresh embedded SQLite file)")
    ] = None,
    intents: Annotated[int, typer.Option(min=1, help="payments to make")] = 200,
    retries: Annotated[int, typer.Option(min=1, help="concurrent callers per payment")] = 4,
    concurrency: Annotated[int, typer.Option(min=1, help="callers at once")] = 16,
    crash: Annotated[bool, typer.Option(help="kill and restart the server mid-storm")] = True,
    serve: Annotated[
        bool, typer.Option("--serve", help="only serve the example payments API")
    ] = False,
    host: Annotated[str, typer.Option(help="with --serve: the address to listen on")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="with --serve: the port to listen on")] = 8000,
) -> None:
    """Serve the example payments API and storm it with retries; check each payment ran once.

    With --serve, only serve the API (docs at /docs, the OpenAPI document at /openapi.json).
    """
    if serve:
        _serve(store, host, port)
        return
    from .demo import run_storm  # noqa: PLC0415 - keeps the other commands fast to start

    with Progress(
        TextColumn("storm"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("storm", total=None)
        report = run_storm(
            store,
            intents=intents,
            retries=retries,
            concurrency=concurrency,
            crash=crash,
            on_progress=lambda done, total: progress.update(task, completed=done, total=total),
        )
    _print_report(report)
    if not report.exactly_once:
        console.print("[red]exactly-once VIOLATED[/red]")
        raise typer.Exit(1)
    console.print("[green]exactly-once held:[/green] every payment charged once, and every")
    console.print("caller of an intent got the same answer, byte for byte.")


def _serve(store: str | None, host: str, port: int) -> None:
    from .example.server import serve  # noqa: PLC0415 - needs the demo extra

    url = store or "sqlite:///idempo-example.db"
    console.print(f"example payments API on http://{host}:{port}  (docs: /docs, store: {url})")
    serve(url, host=host, port=port)


def _print_report(report: Any) -> None:
    tally, ledger = report.tally, report.ledger
    table = Table(title="idempo demo: exactly-once under a retry storm")
    table.add_column("measure")
    table.add_column("count", justify="right")
    for name, value in [
        ("intents (payments wanted)", report.intents),
        ("HTTP requests (every attempt, retries included)", tally.requests),
        ("executions (calls to the payment provider)", ledger["psp_calls"]),
        ("replays of a stored answer", tally.replays),
        ("conflicts (key reused with another payload → 422)", tally.conflicts),
        ("in-progress answers (409, duplicate in flight)", tally.in_progress),
        ("transient failures retried (5xx)", tally.transient),
        ("connections dropped (retried)", tally.dropped),
        ("server crashes (SIGKILL, then restart)", report.crashes),
        ("requests in flight at the crash", tally.cut_off_by_crash),
        ("payments made", ledger["payments"]),
        ("charges at the provider", ledger["charges"]),
        ("declined cards (402, stored and replayed)", report.declined),
        ("intents answered inconsistently", report.inconsistent),
        ("callers left without an answer", tally.unanswered),
        ("double charges", ledger["double_charges"]),
    ]:
        table.add_row(name, str(value))
    console.print(table)


@app.command()
def migrate(url: StoreUrl) -> None:
    """Create the records table (SQL stores)."""
    with _store(url) as store:
        if not hasattr(store, "migrate"):
            console.print(f"{type(store).__name__} keeps no schema; nothing to do")
            return
        store.migrate()
        console.print(f"[green]migrated[/green] {store.dialect.table}")


@app.command()
def purge(
    url: StoreUrl,
    before: Annotated[
        datetime | None, typer.Option(help="purge records expired before this (default: now)")
    ] = None,
    batch: Annotated[int, typer.Option(min=1, help="records per delete")] = 1000,
) -> None:
    """Delete expired records in bounded batches."""
    cutoff = (before or datetime.now(UTC)).astimezone(UTC)
    total = 0
    with _store(url) as store:
        while (deleted := store.purge(before=cutoff, limit=batch)) > 0:
            total += deleted
            if deleted < batch:
                break
    console.print(f"purged {total} record(s) expired before {cutoff.isoformat()}")


@app.command()
def inspect(
    url: StoreUrl,
    key: Annotated[str, typer.Argument(help="the idempotency key")],
    operation: Annotated[str, typer.Option(help="the operation the key is scoped to")],
    principal: Annotated[str, typer.Option(help="the principal (default: anonymous)")] = "",
) -> None:
    """Show one record."""
    with _store(url) as store:
        record = store.get(Scope.of(key, operation=operation, principal=principal))
    if record is None:
        console.print("no record")
        raise typer.Exit(1)
    table = Table(show_header=False)
    for name in ("status", "token", "fingerprint", "lease_expires_at", "created_at",
                 "updated_at", "expires_at", "recovery_point"):  # fmt: skip
        table.add_row(name, str(getattr(record, name)))
    body = record.response or b""
    table.add_row("response", f"{len(body)} bytes: {body[:200]!r}")
    console.print(table)


@app.command()
def stats(url: StoreUrl) -> None:
    """Count records per state."""
    with _store(url) as store:
        counts = store.stats()
    table = Table()
    table.add_column("state")
    table.add_column("records", justify="right")
    for state in ("in_progress", "completed", "failed"):
        table.add_row(state, str(counts.get(state, 0)))
    console.print(table)


def main() -> None:
    """Console entry point."""
    app()
