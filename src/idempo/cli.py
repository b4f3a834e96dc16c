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
) -> None:
    """Fire a storm of concurrent duplicate retries and show that each payment ran once."""
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
            on_progress=lambda done, total: progress.update(task, completed=done, total=total),
        )
    tally = report.tally
    table = Table(title="idempo demo: exactly-once under a retry storm")
    table.add_column("measure")
    table.add_column("count", justify="right")
    for name, value in [
        ("intents (payments wanted)", report.intents),
        ("calls (including retries)", tally.calls),
        ("executions started", tally.executions),
        ("replays of a stored answer", tally.replays),
        ("conflicts (same key, other payload → refused)", tally.conflicts),
        ("in-progress answers (duplicate while in flight)", tally.in_progress),
        ("transient failures retried", tally.transient),
        ("payments charged", sum(report.charges.values())),
        ("intents answered inconsistently", report.inconsistent),
        ("double charges", report.double_charges),
    ]:
        table.add_row(name, str(value))
    console.print(table)
    if report.exactly_once:
        console.print("[green]exactly-once held:[/green] every intent charged once, every caller")
        console.print("got the same answer.")
        return
    console.print("[red]exactly-once VIOLATED[/red]")
    raise typer.Exit(1)


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
