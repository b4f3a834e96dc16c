"""The ``idempo`` command: demo, migrate, purge, inspect, stats, evict, relay; list, resolve
and doctor (`idempo._cli_ops`). ``--json`` on the operator commands prints JSON instead of a
table; ``idempo --version`` prints the version.

Every error is one line on stderr and a non-zero exit (no traceback unless ``--debug``):
1 nothing found (``inspect``, ``evict``), 2 bad input (a URL, a key, an option), 3 the store
failed (unreachable, a file that cannot be opened, a schema never migrated), 4 refused (a live
lease, a settled record, a race with the record's holder lost), 1 anything else.
``doctor`` exits 0, 1 or 2 for its findings (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from . import __version__
from ._core.keys import Scope
from ._purge import BATCH, batch_seconds, purge_records
from .encryption import sealed_key_id
from .errors import ConfigurationError, InvalidKeyError, SchemaMissingError, StoreError
from .stores import MIGRATE_HINT, open_store

if TYPE_CHECKING:
    from .outbox import Outbox

app = typer.Typer(help="idempo: make retries safe.", no_args_is_help=True, add_completion=False)
console = Console()

StoreUrl = Annotated[str, typer.Argument(help="store URL, e.g. sqlite:///app.db or postgresql://…")]
Key = Annotated[str, typer.Argument(help="the idempotency key")]
Operation = Annotated[str, typer.Option(help="the operation the key is scoped to")]
Principal = Annotated[str, typer.Option(help="the principal (default: anonymous)")]
StoredPrincipal = Annotated[
    str | None, typer.Option(help="the principal as stored (default: anonymous)")
]
Authorization = Annotated[
    str | None,
    typer.Option(
        help="the request's Authorization value: the principal is the HTTP middleware's"
        " default for it (its SHA-256)"
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
OutboxTable = Annotated[
    str | None,
    typer.Option(help="the outbox table (default: idempo_outbox beside the records table)"),
]

NOT_FOUND, BAD_INPUT, STORE_FAILED, FAILED, REFUSED = 1, 2, 3, 1, 4


class _Settings:
    debug = False


def _version(shown: bool) -> None:
    if shown:
        typer.echo(f"idempo {__version__}")
        raise typer.Exit


@app.callback()
def _options(
    debug: Annotated[
        bool, typer.Option("--debug", help="on an error, show the traceback too")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_version, help="print the version and exit"
        ),
    ] = False,
) -> None:
    _Settings.debug = debug
    # psycopg's pool logs each failed connection attempt from its own threads; the error
    # the command prints says why it could not connect.
    logging.getLogger("psycopg.pool").disabled = not debug


def _fail(message: str, code: int) -> typer.Exit:
    # Plain text, not rich markup: messages carry brackets (pip install 'idempo[postgres]').
    typer.echo(f"{typer.style('error:', fg='red')} {message}", err=True)
    return typer.Exit(code)


_EVICT_URL = re.compile(r"idempo evict (?:URL|STORE-URL|<store URL>) ")


def _redacted(url: str) -> str:
    """``url`` without its password, to print."""
    return re.sub(r"(//[^/@:]*):[^/@]*@", r"\1:***@", url)


@contextmanager
def _reported(url: str | None = None) -> Iterator[None]:
    """Errors of the block as one line and an exit code; with --debug, as they are."""
    try:
        yield
    except typer.Exit:
        raise
    except Exception as exc:
        if _Settings.debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        if url is not None:
            # The store's message names the command to run; here the URL is known.
            message = message.replace(MIGRATE_HINT, f"idempo migrate {_redacted(url)!r}")
            message = _EVICT_URL.sub(f"idempo evict {_redacted(url)!r} ", message)
        if isinstance(exc, ConfigurationError | InvalidKeyError):
            raise _fail(message, BAD_INPUT) from exc
        if isinstance(exc, StoreError):
            raise _fail(message, STORE_FAILED) from exc
        hint = " (run with --debug for the traceback)"
        raise _fail(f"{type(exc).__name__}: {message}{hint}", FAILED) from exc


@contextmanager
def _store(url: str, *, read_only: bool = False, create: bool = True) -> Iterator[Any]:
    with _reported(url):
        store = open_store(url, read_only=read_only, create=create)
        try:
            yield store
        finally:
            store.close()  # a pool left to the garbage collector complains from its threads


def _scope(
    key: str, operation: str, principal: str | None, authorization: str | None = None
) -> Scope:
    """The scope named on the command line: ``--principal`` as stored, or the HTTP default
    principal of an ``--authorization`` value."""
    with _reported():
        if authorization is not None:
            from .admin import http_principal  # noqa: PLC0415 - keeps the start fast

            principal = http_principal(authorization=authorization, principal=principal)
        return Scope.of(key, operation=operation, principal=principal or "")


def _echo_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2))


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
    with _reported(store):
        _demo(store, intents, retries, concurrency, crash=crash, serve=serve, host=host, port=port)


def _demo(store: str | None, intents: int, retries: int, concurrency: int, *, crash: bool,
          serve: bool, host: str, port: int) -> None:  # fmt: skip
    try:
        from . import demo as storm  # noqa: PLC0415 - keeps the other commands fast to start
    except ImportError as exc:
        raise ConfigurationError(
            f"the demo needs its extra ({exc}): pip install 'idempo[demo]'"
        ) from exc
    if serve:
        _serve(store, host, port)
        return

    if store is not None:
        storm.backend_kind(store)  # an unsupported store: one line, before anything starts

    def started(url: str) -> None:
        where = "a fresh SQLite file, removed at the end" if store is None else "as given"
        console.print(f"store: {escape(_redacted(url))} ({where})")

    with Progress(
        # One caller answered is one step: each intent has --retries callers, at once.
        TextColumn("callers answered"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("storm", total=intents * retries)
        report = storm.run_storm(
            store,
            intents=intents,
            retries=retries,
            concurrency=concurrency,
            crash=crash,
            on_progress=lambda done, total: progress.update(task, completed=done, total=total),
            on_start=started,
        )
    _print_report(report)
    if not report.exactly_once:
        console.print("[red]exactly-once VIOLATED[/red]")
        if report.server_log:
            console.print("the example server's last lines:")
            console.print(Text(report.server_log))
        raise typer.Exit(1)
    console.print("[green]exactly-once held:[/green] every payment charged once, and every")
    console.print("caller of an intent got the same answer, byte for byte.")
    if report.events is not None:
        console.print("Every payment.captured event was applied downstream once.")


def _serve(store: str | None, host: str, port: int) -> None:
    from .example.server import serve  # noqa: PLC0415 - needs the demo extra

    url = store or "sqlite:///idempo-example.db"
    where = escape(f"http://{host}:{port}  (docs: /docs, store: {_redacted(url)})")
    console.print(f"example payments API on {where}")
    serve(url, host=host, port=port)


def _print_report(report: Any) -> None:
    tally, ledger = report.tally, report.ledger
    table = Table(title="idempo demo: exactly-once under a retry storm")
    table.add_column("measure")
    table.add_column("count", justify="right")
    for name, value in [
        ("intents (payments wanted)", report.intents),
        ("  paid (201)", report.paid),
        ("  declined cards (402, stored and replayed)", report.declined),
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
        ("intents answered inconsistently", report.inconsistent),
        ("callers left without an answer", tally.unanswered),
        ("double charges", ledger["double_charges"]),
        *report.event_rows(),
    ]:
        table.add_row(name, str(value))
    table.caption = (
        f"intents = paid + declined: {report.intents} = {report.paid} + {report.declined}"
    )
    console.print(table)


@app.command()
def migrate(url: StoreUrl, outbox_table: OutboxTable = None, as_json: AsJson = False) -> None:
    """Create the records table, the outbox table and what they need (SQL stores); safe to
    run again."""
    with _store(url) as store:
        kind = type(store).__name__
        if not hasattr(store, "migrate"):
            if as_json:
                _echo_json({"store": kind, "migrated": False, "table": None, "outbox": None})
                return
            console.print(f"{escape(kind)} keeps no schema; nothing to do")
            return
        store.migrate()
        outbox = _outbox(store, outbox_table)
        if outbox is not None:
            outbox.migrate(store)
    if as_json:
        table = None if outbox is None else store.dialect.table
        _echo_json({"store": kind, "migrated": True, "table": table,
                    "outbox": None if outbox is None else outbox.table})  # fmt: skip
        return
    if outbox is None:  # a store with a schema of its own but no SQL tables
        console.print(f"[green]migrated[/green] {escape(kind)}")
        return
    console.print(
        f"[green]migrated[/green] {escape(store.dialect.table)} and {escape(outbox.table)}"
    )


def _outbox(store: Any, table: str | None) -> Outbox | None:
    """The outbox beside ``store``'s records (or in ``table``); None for a store without SQL."""
    if getattr(store, "dialect", None) is None:
        return None
    from .outbox import Outbox, outbox_table  # noqa: PLC0415 - only the SQL stores need it

    return Outbox(table or outbox_table(store.dialect.table))


@app.command()
def purge(
    url: StoreUrl,
    before: Annotated[
        datetime | None,
        typer.Option(help="purge records expired before this (default: the store's now)"),
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="records per delete (default 1000); with a batch time, the most per delete"
            " (default 10000)",
        ),
    ] = None,
    batch_time: Annotated[
        str | None,
        typer.Option(
            help="size each delete to take about this long: seconds (0.005) or ms (5ms);"
            " 0: fixed batches of --batch (default: the store's own: PostgreSQL 1ms, MariaDB 10ms)",
            show_default=False,
        ),
    ] = None,
    rest: Annotated[
        float,
        typer.Option(min=0, help="after each batch, pause this many times as long as it took"),
    ] = 1.0,
    outbox_retention: Annotated[
        float,
        typer.Option(min=0, help="also purge outbox messages sent more than this many seconds ago"),
    ] = 86400.0,
    outbox_table: OutboxTable = None,
    as_json: AsJson = False,
) -> None:
    """Delete expired records, and outbox messages sent past their retention, in bounded
    batches. Pending outbox messages are never purged."""
    cutoff = None if before is None else before.astimezone(UTC)
    sent = 0
    outbox_missing = False
    with _reported():
        budget = None if batch_time is None else batch_seconds(batch_time)
    with _store(url, create=False) as store:
        total = purge_records(store, batch=batch, batch_time=budget, before=cutoff, rest=rest)
        outbox = _outbox(store, outbox_table)
        if outbox is not None:
            retention = timedelta(seconds=outbox_retention)
            try:
                limit = batch or BATCH
                while (deleted := outbox.purge(store, retention=retention, limit=limit)) > 0:
                    sent += deleted
                    if deleted < limit:
                        break
            except SchemaMissingError:
                outbox_missing = True  # migrated before the outbox existed: nothing to purge
    when = "now (the store's clock)" if cutoff is None else cutoff.isoformat()
    if as_json:
        swept = None if outbox is None or outbox_missing else sent
        _echo_json({"records": total, "before": None if cutoff is None else when,
                    "outbox_messages": swept})  # fmt: skip
        return
    console.print(f"purged {total} record(s) expired before {escape(when)}")
    if outbox is not None and not outbox_missing:
        console.print(f"purged {sent} outbox message(s) sent more than {outbox_retention:g} s ago")


@app.command()
def inspect(
    url: StoreUrl,
    key: Key,
    operation: Operation,
    principal: StoredPrincipal = None,
    authorization: Authorization = None,
    as_json: AsJson = False,
) -> None:
    """Show one record, by the key as the app sees it: --principal as stored, or
    --authorization "Bearer …" for the HTTP middleware's default principal."""
    scope = _scope(key, operation, principal, authorization)
    with _store(url, read_only=True) as store:
        record = store.get(scope)
    if as_json:
        from .admin import record_dict  # noqa: PLC0415 - keeps the start fast

        _echo_json(None if record is None else record_dict(record))
        if record is None:
            raise typer.Exit(NOT_FOUND)
        return
    if record is None:
        console.print("no record")
        raise typer.Exit(NOT_FOUND)
    table = Table(show_header=False)
    for name in ("status", "token", "fingerprint", "lease_expires_at", "created_at",
                 "updated_at", "expires_at", "recovery_point"):  # fmt: skip
        table.add_row(name, Text(str(getattr(record, name))))
    body = record.response or b""
    key_id = sealed_key_id(body)
    shown = f"sealed with key {key_id!r}" if key_id is not None else repr(body[:200])
    table.add_row("response", Text(f"{len(body)} bytes: {shown}"))
    console.print(table)


@app.command()
def stats(url: StoreUrl, outbox_table: OutboxTable = None, as_json: AsJson = False) -> None:
    """Count records per state, and the outbox's backlog."""
    backlog: dict[str, int] | None = None
    with _store(url, read_only=True) as store:
        counts = store.stats()
        outbox = _outbox(store, outbox_table)
        if outbox is not None:
            try:
                backlog = outbox.stats(store)
            except SchemaMissingError:
                backlog = None
    if as_json:
        records = {state: counts.get(state, 0) for state in ("in_progress", "completed", "failed")}
        outbox_counts = None
        if backlog is not None:
            outbox_counts = {name: backlog.get(name, 0) for name in ("pending", "failing", "sent")}
        _echo_json({"records": records, "outbox": outbox_counts})
        return
    table = Table()
    table.add_column("state")
    table.add_column("records", justify="right")
    for state in ("in_progress", "completed", "failed"):
        table.add_row(state, str(counts.get(state, 0)))
    console.print(table)
    if outbox is None:
        return
    if backlog is None:
        console.print(f"outbox: no table {escape(outbox.table)} (idempo migrate creates it)")
        return
    shown = Table()
    shown.add_column("outbox")
    shown.add_column("messages", justify="right")
    for name, what in (("pending", "pending (not sent yet)"),
                       ("failing", "failing (pending, tried before)"),
                       ("sent", "sent (kept until purged)")):  # fmt: skip
        shown.add_row(what, str(backlog.get(name, 0)))
    console.print(shown)


@app.command()
def evict(
    url: StoreUrl,
    key: Key,
    operation: Operation,
    principal: StoredPrincipal = None,
    authorization: Authorization = None,
    force: Annotated[
        bool, typer.Option("--force", help="also delete a record under a live lease")
    ] = False,
    as_json: AsJson = False,
) -> None:
    """Delete one record whatever its state (a corrupt record, an operator's decision).

    A retry of the key then runs the work again; its tokens still grow past the evicted
    record's. A record in progress under a live lease is refused (exit 4) unless --force:
    its holder may be running.
    """
    from .admin import Admin, LiveLeaseError  # noqa: PLC0415 - keeps the start fast

    scope = _scope(key, operation, principal, authorization)
    with _store(url, create=False) as store:
        try:
            evicted = Admin(store).evict(scope, force=force)
        except LiveLeaseError as exc:
            raise _fail(str(exc), REFUSED) from exc
    if as_json:
        _echo_json({"evicted": evicted, "key": scope.key, "operation": scope.operation,
                    "principal": scope.principal})  # fmt: skip
        if not evicted:
            raise typer.Exit(NOT_FOUND)
        return
    if not evicted:
        console.print("no record")
        raise typer.Exit(NOT_FOUND)
    console.print(f"evicted the record of key {escape(repr(key))} ({escape(operation)})")


@app.command()
def relay(
    store: Annotated[
        str, typer.Option("--store", help="the store URL (its database has the outbox)")
    ],
    to: Annotated[str, typer.Option("--to", help="the publisher URL: amqp://, nats://, redis://")],
    once: Annotated[bool, typer.Option("--once", help="publish what is due, then exit")] = False,
    batch: Annotated[int, typer.Option(min=1, help="messages per claim")] = 100,
    poll: Annotated[
        float, typer.Option(min=0.001, help="seconds between claims when nothing is due")
    ] = 1.0,
    outbox_table: OutboxTable = None,
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-o", help="NAME=VALUE for the publisher (repeatable)"),
    ] = None,
) -> None:
    """Publish staged outbox messages, mark them sent, retry failures with backoff.

    Runs until stopped (Ctrl-C, SIGTERM), or with --once until nothing is due. Several relays
    may run at once. Exit 1 with --once if a message failed to publish (it is retried later).
    """
    with _reported(store):
        options = dict(_option(item) for item in option or ())
        sent, failed = asyncio.run(_relay(store, to, options, once=once, batch=batch, poll=poll,
                                          table=outbox_table))  # fmt: skip
    if once:
        console.print(f"published {sent} message(s); {failed} failed (retried later)")
        if failed:
            raise typer.Exit(FAILED)


def _option(item: str) -> tuple[str, str]:
    name, equals, value = item.partition("=")
    if not equals or not name.isidentifier():
        raise ConfigurationError(f"--option takes NAME=VALUE, not {item!r}")
    return name, value


async def _relay(store: str, to: str, options: dict[str, str], *, once: bool, batch: int,
                 poll: float, table: str | None) -> tuple[int, int]:  # fmt: skip
    from .outbox import Relay, publishers  # noqa: PLC0415 - only this command needs them

    publisher = publishers.open_publisher(to, **options)
    try:
        async with Relay(store, publisher, table=table, batch=batch, poll=poll) as relay:
            if once:
                drained = await relay.drain()
                return drained.sent, drained.failed
            console.print(
                f"relaying {escape(_redacted(store))} -> {escape(_redacted(to))} (Ctrl-C to stop)"
            )
            task = relay.start()
            loop = asyncio.get_running_loop()
            # Ctrl-C and SIGTERM (a service manager's stop) cancel the relay: the batch in
            # flight ends as `Relay.run` says, and the command exits 0.
            for stop in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(stop, task.cancel)
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this coroutine itself was cancelled, not the relay
            finally:
                for stop in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(stop)
            console.print(f"stopped: published {relay.sent} message(s), {relay.failed} failed")
            return relay.sent, relay.failed
    finally:
        await publisher.aclose()


# click's UsageError and ClickException, as the typer installed raises them: typer 0.2x
# raises those of the click it carries inside, earlier versions plain click's. Both are
# reached from typer's public BadParameter.
_USAGE_ERROR: type[Exception] = next(
    kind for kind in typer.BadParameter.__mro__ if kind.__name__ == "UsageError"
)
_CLICK_ERROR: type[Exception] = _USAGE_ERROR.__mro__[1]


def main() -> None:
    """Console entry point.

    A usage error (an unknown option, a missing argument, a value of the wrong type or out
    of range) is one line and exit 2, as every other error of the CLI (SPEC §8), instead of
    the usage and a boxed message; the line names the command's ``--help``. Help, and a bare
    ``idempo``, print as typer prints them.
    """
    try:
        code = app(standalone_mode=False)
    except _CLICK_ERROR as exc:
        exit_code: int = getattr(exc, "exit_code", BAD_INPUT)
        ctx = getattr(exc, "ctx", None)
        # NoArgsIsHelpError: typer printed the help already (it imports no such name either).
        if type(exc).__name__ != "NoArgsIsHelpError":
            if isinstance(exc, _USAGE_ERROR) and ctx is not None:
                help_hint = f" (see {ctx.command_path} --help)"
            else:
                help_hint = ""
            _fail(f"{getattr(exc, 'format_message', exc.__str__)()}{help_hint}", exit_code)
        sys.exit(exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(1)
    # What comes back is an Exit's code (typer.Exit, --help, --version): every command
    # returns None.
    sys.exit(code if isinstance(code, int) else 0)


# The operator commands (list, resolve, doctor) register on `app`; last, since they import it.
from . import _cli_ops  # noqa: E402, F401
