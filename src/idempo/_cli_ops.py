"""The operator commands of ``idempo``: ``list``, ``resolve`` and ``doctor``.

They register on `idempo.cli.app` when this module is imported (cli.py imports it last).
Errors follow cli.py's rules: one line on stderr, no traceback unless ``--debug``; exit 1
nothing found, 2 bad input, 3 the store failed, 4 refused (a live lease, a settled record, a
race with the record's holder lost). ``doctor`` exits 0 all passed, 1 a warning, 2 a failure.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from . import admin
from ._core.keys import Scope
from .cli import NOT_FOUND, _fail, _redacted, _reported, _store, app, console
from .doctor import Level, diagnose, parse_duration
from .encryption import KeyRing
from .errors import ConfigurationError, FencedError

REFUSED = 4

StoreUrl = Annotated[str, typer.Argument(help="store URL, e.g. sqlite:///app.db or postgresql://…")]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
Authorization = Annotated[
    str | None,
    typer.Option(
        help="the request's Authorization value: the principal is computed as the HTTP"
        " middleware's default (its SHA-256)"
    ),
]


def _duration(text: str | None) -> timedelta | None:
    if text is None:
        return None
    with _reported():
        return parse_duration(text)


def _scope(key: str, operation: str, principal: str | None, authorization: str | None) -> Scope:
    with _reported():
        if authorization is not None:
            chosen = admin.http_principal(authorization=authorization, principal=principal)
        else:
            chosen = principal or ""
        return Scope.of(key, operation=operation, principal=chosen)


@contextmanager
def _refusals() -> Iterator[None]:
    """The admin API's refusals as one line and their exit code."""
    try:
        yield
    except admin.NoRecordError as exc:
        raise _fail(str(exc), NOT_FOUND) from exc
    except (admin.LiveLeaseError, admin.NotInProgressError, FencedError) as exc:
        raise _fail(str(exc), REFUSED) from exc


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def _lease(data: dict[str, Any], now: datetime) -> str:
    if data["lease"] is None:
        return "-"
    left = (datetime.fromisoformat(data["lease_expires_at"]) - now).total_seconds()
    return f"live ({_age(left)} left)" if data["lease"] == "live" else f"ended {_age(-left)} ago"


def _echo_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=False))


@app.command("list")
def list_(
    url: StoreUrl,
    status: Annotated[str | None, typer.Option(help="in_progress, completed or failed")] = None,
    operation: Annotated[str | None, typer.Option(help="only this operation")] = None,
    principal: Annotated[str | None, typer.Option(help="only this principal, as stored")] = None,
    older_than: Annotated[
        str | None, typer.Option(help="created more than this long ago: 90s, 5m, 24h, 7d")
    ] = None,
    in_progress_for: Annotated[
        str | None, typer.Option(help="in progress for more than this long: stuck keys (5m)")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=10000, help="at most this many")] = 100,
    as_json: AsJson = False,
) -> None:
    """List records, oldest first: by state, operation, principal and age.

    `idempo list URL --in-progress-for 5m` finds keys stuck in progress for five minutes.
    """
    older, stuck = _duration(older_than), _duration(in_progress_for)
    now = datetime.now(UTC)
    with _store(url, read_only=True) as store:
        records = admin.Admin(store).list_records(
            status=status,
            operation=operation,
            principal=principal,
            older_than=older,
            in_progress_for=stuck,
            limit=limit,
            now=now,
        )
    rows = admin.listed(records, now=now)
    if as_json:
        _echo_json(rows)
        return
    if not rows:
        console.print("no records")
        return
    table = Table()
    # The digest column matches a log line's idempo_key_digest to its key.
    for column in ("key", "digest", "operation", "principal", "status", "token", "age", "lease"):
        table.add_column(column, overflow="fold")
    for row in rows:
        principal_shown = row["principal"] or "(anonymous)"
        if len(principal_shown) > 24:
            principal_shown = principal_shown[:12] + "…" + principal_shown[-8:]
        table.add_row(
            Text(row["key"]),
            row["key_digest"],
            Text(row["operation"]),
            Text(principal_shown),
            row["status"],
            str(row["token"]),
            _age(row["age_seconds"]),
            _lease(row, now),
        )
    console.print(table)
    if len(rows) == limit:
        console.print(f"(the first {limit}; --limit shows more)")


@app.command()
def resolve(
    url: StoreUrl,
    key: Annotated[str, typer.Argument(help="the idempotency key")],
    operation: Annotated[str, typer.Option(help="the operation the key is scoped to")],
    fail: Annotated[
        str, typer.Option("--fail", help="the reason every retry of the key will be told")
    ],
    principal: Annotated[
        str | None, typer.Option(help="the principal as stored (a resolver's value)")
    ] = None,
    authorization: Authorization = None,
    force: Annotated[
        bool, typer.Option("--force", help="also end a record under a live lease")
    ] = False,
    format: Annotated[
        str,
        typer.Option(
            help="how the failure is stored: http (a problem response), function (a replayed"
            " error), auto (http for operations like 'POST /path')"
        ),
    ] = "auto",
    status: Annotated[int, typer.Option(help="the HTTP status retries get (http format)")] = 500,
    encryption_env: Annotated[
        str | None,
        typer.Option(
            help="seal the answer with the key ring in this environment variable"
            " (id:base64,...), as the app's guard given encryption= does"
        ),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """End an in-progress record as FAILED with a stored problem, fenced on its token.

    Every retry of the key then gets that answer, and the holder, if it is still running,
    cannot complete over it. A record under a live lease is refused unless --force.
    """
    scope = _scope(key, operation, principal, authorization)
    if format not in ("auto", "http", "function"):
        raise _fail(f"--format is auto, http or function, not {format!r}", 2)
    ring = None
    if encryption_env is not None:
        try:
            ring = KeyRing.from_env(encryption_env)
        except ConfigurationError as exc:
            raise _fail(str(exc), 2) from None
    with _store(url, create=False) as store, _refusals():
        record = admin.Admin(store, encryption=ring).resolve(
            scope,
            fail,
            force=force,
            format=format,  # type: ignore[arg-type]
            http_status=status,
        )
    if as_json:
        _echo_json(admin.record_dict(record))
        return
    console.print(
        f"resolved key {escape(repr(key))} ({escape(operation)}) as failed, token"
        f" {record.token}: retries get {escape(repr(fail))}"
    )


@app.command()
def doctor(
    url: StoreUrl,
    horizon: Annotated[
        str | None,
        typer.Option(help="how long retries may keep coming (7d): the retention must cover it"),
    ] = None,
    retention: Annotated[
        str | None,
        typer.Option(
            help="the app's Policy(ttl=...) (default: what stored records show, else 24h)"
        ),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Check what exactly-once depends on in the store, and say what to change.

    Exit 0: every check passed; 1: a warning; 2: a failure; 3: the store could not be
    examined.
    """
    wanted, kept = _duration(horizon), _duration(retention)
    with _reported(url):
        report = diagnose(url, horizon=wanted, retention=kept)
    if as_json:
        _echo_json({"url": _redacted(url), **report.as_dict()})
        raise typer.Exit(report.exit_code)
    _print_report(console, url, report)
    raise typer.Exit(report.exit_code)


_STYLE = {Level.PASS: "green", Level.WARN: "yellow", Level.FAIL: "red"}


def _print_report(out: Console, url: str, report: Any) -> None:
    table = Table(title=f"idempo doctor: {escape(_redacted(url))} ({report.store})")
    table.add_column("check")
    table.add_column("result")
    table.add_column("found")
    table.add_column("what to change")
    for finding in report.findings:
        style = _STYLE[finding.level]
        table.add_row(
            finding.check,
            Text(finding.level.value.upper(), style=style),
            Text(finding.summary),
            Text(finding.fix or ""),
        )
    out.print(table)
    verdict = {0: "all checks passed", 1: "warnings", 2: "failures"}[report.exit_code]
    out.print(f"{verdict} (exit {report.exit_code})")
