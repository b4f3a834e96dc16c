"""The store's statements sent straight through libpq, on a psycopg connection.

psycopg spends more on each ``execute`` than a replay spends on anything else: a cursor and
its adapters made anew, the query converted and looked up in the prepared-statement cache,
its results fetched through the cursor, and a pipeline's bookkeeping on top (about 35 Python
calls a statement; a transactional call sends seven). The statements here are the store's
own, fixed text, so this sends them with libpq's calls through psycopg's public ``pq`` layer
(``conn.pgconn``): one pipeline, one Sync, parameters dumped and rows loaded by psycopg's
own adapters (a `Transformer` of the connection, so the connection's adapters apply), under
the connection's lock, waiting with the connection's own ``wait``, which cancels on the
server what an interrupt cuts short.

**Prepared statements of its own.** Each parameterised statement is prepared once per
session under a name of its own (``idempo_`` and a digest of its text), with its Parse in the
same pipeline as its first use: no round trip for it. A name can vanish behind the store's
back: psycopg sends ``DEALLOCATE ALL`` after the app's ROLLBACK (a nested transaction's
too) whenever it holds prepared statements of its own, and an app may run it itself. The
server then refuses the statement (SQLSTATE 26000) and the batch is sent again with the
Parse, in a second round trip, without anything lost:

* a batch that starts outside a transaction (the store's own connections; a transaction the
  guard begins) starts over: the server rolled back what the batch began, or is told to;
* a batch that runs inside a transaction (the completion, after the app's writes) takes a
  savepoint of its own before the first prepared statement, rolls back to it, and goes on
  from there; the savepoint is released after the last one, or ends with the COMMIT behind
  it.

A connection whose ``prepare_threshold`` is None (psycopg's setting for a PgBouncer that
keeps no prepared statements) gets unnamed statements, parsed on every use, as psycopg
does.

**The connection as psycopg knows it.** psycopg keeps no state of a statement it did not
send: the transaction status is libpq's (BEGIN and COMMIT sent here are seen by psycopg as
the app's would be), notices and notifications reach the connection's handlers as they
arrive, and the pipeline mode entered here is left before the lock is let go. A batch cut
short (an interrupt, a cancellation) is read to its Sync before the connection is given back;
if that fails too, the connection is closed, as psycopg closes one whose query it could not
stop. A connection the app drives in psycopg's pipeline mode is not touched here.
"""

from __future__ import annotations

import hashlib
import operator
import re
import weakref
from collections.abc import Callable, Generator
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any, NamedTuple, cast

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.abc import AdaptContext
from psycopg.adapt import Transformer
from psycopg.waiting import Ready, Wait

_IDLE = pq.TransactionStatus.IDLE
_OK = pq.ConnStatus.OK
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR
_PIPELINE_SYNC = pq.ExecStatus.PIPELINE_SYNC
_ABORTED = pq.ExecStatus.PIPELINE_ABORTED
_SQLSTATE = pq.DiagnosticField.SQLSTATE
_TEXT, _BINARY = pq.Format.TEXT, pq.Format.BINARY
_WAIT_R, _WAIT_RW, _READY_R = Wait.R, Wait.RW, Ready.R
_NAMED_PARAM = re.compile(r"(?<!:):([a-z_]+)")

# A prepared statement the session does not have; one that it has already.
_MISSING, _EXISTS = b"26000", b"42P05"

# The savepoint a batch inside a transaction takes before its first prepared statement.
_SAFE = b"SAVEPOINT idempo_safe"
_BACK_TO_SAFE = b"ROLLBACK TO SAVEPOINT idempo_safe"
_SAFE_DONE = b"RELEASE SAVEPOINT idempo_safe"
_ROLLBACK = b"ROLLBACK"
_COMMITS = frozenset(("COMMIT", b"COMMIT"))


class Compiled(NamedTuple):
    """A statement as libpq takes it: ``$n`` placeholders, the name it is prepared under in
    every session, and how to take its parameters' values from a dict, in ``$n`` order."""

    query: bytes
    name: bytes
    values: Callable[[dict[str, Any]], tuple[Any, ...]]


@lru_cache(maxsize=256)
def compiled(sql: str | bytes) -> Compiled:
    """``sql`` with ``:name`` parameters, compiled once."""
    text = sql.decode() if isinstance(sql, bytes) else sql
    order: list[str] = []

    def number(found: re.Match[str]) -> str:
        name = found[1]
        if name not in order:
            order.append(name)
        return f"${order.index(name) + 1}"

    query = _NAMED_PARAM.sub(number, text).encode()
    digest = hashlib.sha256(query).hexdigest()[:24]
    return Compiled(query, f"idempo_{digest}".encode(), _values(order))


def _values(names: list[str]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """A builtin that takes ``names``' values from a dict, as a tuple (no Python frame)."""
    if len(names) > 1:
        return operator.itemgetter(*names)
    name = names[0] if names else ""

    def one(params: dict[str, Any]) -> tuple[Any, ...]:
        # itemgetter of one name answers the value itself, not a tuple of it.
        return (params[name],) if name else ()

    return one


def dumped(values: tuple[Any, ...], encoding: str) -> tuple[list[Any], list[pq.Format] | None]:
    """The parameters' values as libpq sends them: text, as PostgreSQL reads each type's
    literal, but bytes in binary (a bytea's text form is twice its size, and a stored
    response may be large); and their formats (None: all text). Made here rather than by
    psycopg's dumpers, which cost a lookup and an object each; the statements' parameters
    are of these few types only."""
    out: list[Any] = []
    formats: list[pq.Format] | None = None
    for i, value in enumerate(values):
        kind = type(value)
        if kind is str:
            out.append(value.encode(encoding))
        elif value is None:
            out.append(None)
        elif kind is int:
            out.append(b"%d" % value)
        elif kind is bytes:
            if formats is None:
                formats = [_TEXT] * len(values)
            formats[i] = _BINARY
            out.append(value)
        else:
            out.append(_literal(value))
    return out, formats


@lru_cache(maxsize=128)
def _interval(span: timedelta) -> bytes:
    # Days as days, as psycopg sends a timedelta (a day added in a time zone with daylight
    # saving is a calendar day).
    return f"{span.days} days {span.seconds}.{span.microseconds:06d} seconds".encode()


def _literal(value: Any) -> bytes:
    """A value of the rarer types as PostgreSQL's text input reads it."""
    if isinstance(value, timedelta):
        return _interval(value)
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise TypeError("a naive datetime: the store's times are aware")
        return value.isoformat().encode()
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, int):  # an int subclass
        return b"%d" % value
    raise TypeError(f"no parameter of type {type(value).__name__} is sent this way")


class _Context:
    """What the Transformer of a session whose client encoding is not UTF-8 is made from:
    psycopg's own adapters (the app's on its connection are for its statements), and the
    connection for its encoding, by a weak reference, so that the session kept on the
    connection makes no reference cycle that would keep a dropped connection open until the
    next garbage collection."""

    adapters = psycopg.adapters

    def __init__(self, conn: Any) -> None:
        self.connection = weakref.proxy(conn)


class _Session:
    """What this module knows of one connection's session: the statements it prepared
    there, the client encoding it was made for, and a Transformer that loads the rows (cheap
    to keep, not to make).

    Rows come in binary. In a UTF-8 session (the usual one) the Transformer is made with no
    connection: it decodes text as UTF-8 and gives times in UTC, which is what the record's
    decode wants (psycopg's, made with the connection, gives them in the session's time
    zone, to be converted back: two conversions of each of the five times of a
    reservation's row)."""

    def __init__(self, conn: Any) -> None:
        self.prepared: set[bytes] = set()
        self.client_encoding = conn.pgconn.parameter_status(b"client_encoding")
        self.encoding = conn.info.encoding
        utf8 = self.client_encoding == b"UTF8"
        self.adapt = Transformer(None if utf8 else cast(AdaptContext, _Context(conn)))


# The session of a connection, kept on it: a connection is one session for its life.
_SESSION = "_idempo_session"

# One message of a batch: the index of the caller's statement it answers (-1: one of this
# module's own: a savepoint, a Parse, a rollback), its SQL, and for a statement with
# parameters their values (dumped) and formats, and its prepared name (b"": unnamed). A
# Parse is ``(-1, query, None, None, name)``.
Step = tuple[int, bytes, Any, Any, bytes]

# What a statement the server skipped, after an earlier one of its batch failed, answered.
SKIPPED: Any = type("Skipped", (), {"__repr__": lambda self: "SKIPPED"})()


def exchange(conn: Any, pending: list[tuple[Any, Any]]) -> Generator[Any, Any, list[Any]]:
    """Send ``pending`` (``(sql, params)``, params None for a statement that has none) in
    one pipeline: what each statement answered, its rows (None when it returns none), the
    error it raised, or `SKIPPED`. A generator of libpq's waits (psycopg's generators), one
    per round trip, for the connection's ``wait`` (sync or async) to run while its caller
    holds the connection's lock."""
    pgconn = conn.pgconn
    session: _Session | None = getattr(conn, _SESSION, None)
    if session is None or session.client_encoding != pgconn.parameter_status(b"client_encoding"):
        session = _Session(conn)
        setattr(conn, _SESSION, session)
    named = conn.prepare_threshold is not None
    # Outside a transaction a failure loses nothing of anyone's: the batch starts over.
    fresh = pgconn.transaction_status == _IDLE
    first = -1 if fresh or not named else _guarded(pending)
    answers: list[Any] = [SKIPPED] * len(pending)
    steps = _steps(pending, 0, b"", session, named, first)
    results = yield from _roundtrip(pgconn, steps)
    if not _answer(steps, results, answers, session):
        return answers
    # A prepared statement had vanished (its name is forgotten now), or its Parse found it
    # there: the batch goes again, with the Parse, from where nothing is lost.
    if fresh:
        start, undo = 0, b"" if pgconn.transaction_status == _IDLE else _ROLLBACK
    else:
        start, undo = first, _BACK_TO_SAFE
    answers[start:] = [SKIPPED] * (len(pending) - start)
    steps = _steps(pending, start, undo, session, named, first)
    results = yield from _roundtrip(pgconn, steps)
    _answer(steps, results, answers, session)
    return answers


def _guarded(pending: list[tuple[Any, Any]]) -> int:
    """Where the savepoint of a batch inside a transaction goes: before its first prepared
    statement (its index; -1 for none)."""
    return next((i for i, (_, params) in enumerate(pending) if params is not None), -1)


def _steps(
    pending: list[tuple[Any, Any]],
    start: int,
    undo: bytes,
    session: _Session,
    named: bool,
    first: int,
) -> list[Step]:
    """The messages that send ``pending`` from its statement ``start`` on: ``undo`` first
    (what undoes a failed try), each prepared statement's Parse before its first use in the
    session, and from ``first`` on (-1: none) inside a savepoint, released after the last
    prepared statement unless a COMMIT ends it. A retry reuses the savepoint: a rollback to
    it keeps it."""
    steps: list[Step] = []
    if undo:
        steps.append((-1, undo, None, None, b""))
    encoding = session.encoding
    prepared = session.prepared
    last = -1
    for i in range(start, len(pending)):
        sql, params = pending[i]
        if params is None:
            steps.append((i, sql.encode() if type(sql) is str else sql, None, None, b""))
            continue
        if i == first and not undo:
            steps.append((-1, _SAFE, None, None, b""))
        query, name, take = compiled(sql)
        values, formats = dumped(take(params), encoding)
        if not named:
            name = b""
        elif name not in prepared:
            steps.append((-1, query, None, None, name))
        steps.append((i, query, values, formats, name))
        last = len(steps)
    if first >= 0 and last >= 0:
        after = steps[last][1] if last < len(steps) else None
        if after not in _COMMITS:
            steps.insert(last, (-1, _SAFE_DONE, None, None, b""))
    return steps


def _roundtrip(pgconn: Any, steps: list[Step]) -> Generator[Any, Any, list[Any]]:
    """Send ``steps`` in one pipeline; each one's result, once the Sync's has come."""
    pgconn.enter_pipeline_mode()
    synced = False
    try:
        for at, sql, params, formats, name in steps:
            if not name:
                pgconn.send_query_params(sql, params, None, formats, _BINARY)
            elif at < 0 and params is None:
                pgconn.send_prepare(name, sql)
            else:
                pgconn.send_query_prepared(name, params, formats, _BINARY)
        pgconn.pipeline_sync()
        synced = True
        results: list[Any] = yield _communicate(pgconn)
    except BaseException:
        yield from _abandon(pgconn, synced)
        raise
    pgconn.exit_pipeline_mode()
    return results


def _communicate(pgconn: Any) -> Generator[Wait, Ready | None, list[Any]]:
    """Flush what was sent, then read every result up to the pipeline's Sync: one wait of
    the connection's (psycopg's generator protocol). Notifications that arrive meanwhile
    go to the connection's handler, as psycopg's own reads pass them on."""
    while pgconn.flush():
        ready = yield _WAIT_RW
        if ready and ready & _READY_R:
            pgconn.consume_input()
    results: list[Any] = []
    while True:
        if pgconn.is_busy():
            if (yield _WAIT_R):
                pgconn.consume_input()
            continue
        result = pgconn.get_result()
        if result is None:
            continue  # the end of one statement's results
        if result.status == _PIPELINE_SYNC:
            _notified(pgconn)
            return results
        results.append(result)


def _notified(pgconn: Any) -> None:
    handler = pgconn.notify_handler
    while (notify := pgconn.notifies()) is not None:
        if handler is not None:
            handler(notify)


def _abandon(pgconn: Any, synced: bool) -> Generator[Any, Any, None]:
    """After a batch was cut short: read what is left of it up to its Sync and leave the
    pipeline mode, so the connection is in step for its next user; close it if that fails
    (a broken connection, a second interrupt), as psycopg closes one it could not stop."""
    try:
        if pgconn.status == _OK:
            try:
                pgconn.exit_pipeline_mode()  # nothing left unread: done
            except pg_errors.Error:
                if not synced:
                    pgconn.pipeline_sync()
                yield _communicate(pgconn)
                pgconn.exit_pipeline_mode()
            return
    except BaseException:  # noqa: BLE001, S110 - closed below: its state is unknown
        pass
    pgconn.finish()


def _answer(steps: list[Step], results: list[Any], answers: list[Any], session: _Session) -> bool:
    """Fill ``answers`` from the results: True when the batch must be sent again because a
    prepared statement had vanished (or, its Parse says, was there already)."""
    adapt = session.adapt
    for i, result in enumerate(results):
        status = result.status
        at = steps[i][0]
        if status == _TUPLES_OK:
            if at >= 0:
                adapt.set_pgresult(result)
                answers[at] = adapt.load_rows(0, result.ntuples, tuple)
        elif status == _FATAL_ERROR:
            return _failed(steps, i, result, answers, session)
        elif status != _ABORTED:
            if at >= 0:
                answers[at] = None
            elif steps[i][4]:  # a Parse
                session.prepared.add(steps[i][4])
    return False


def _failed(steps: list[Step], i: int, result: Any, answers: list[Any], session: _Session) -> bool:
    """Record the error of the batch's step ``i``: True when it is a prepared statement's
    name gone from the session, or found there by its Parse (the batch is sent again)."""
    at, _, params, _, name = steps[i]
    if at < 0:  # one of this module's own: the error is the next statement's
        at = next((step[0] for step in steps[i:] if step[0] >= 0), -1)
    answers[at] = pg_errors.error_from_result(result, encoding=session.encoding)
    state = result.error_field(_SQLSTATE)
    if name and params is None and state == _EXISTS:  # a Parse
        session.prepared.add(name)
        return True
    if name and params is not None and state == _MISSING:
        session.prepared.discard(name)
        return True
    return False
