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

from ._sql.postgres import pg_interval

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
_COMMIT = b"COMMIT"


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


def dumped(values: tuple[Any, ...], encoding: str) -> list[Any]:
    """The parameters' values as libpq sends them: text, as PostgreSQL reads each type's
    literal, but bytes as they are (in binary: a bytea's text form is twice its size, and a
    stored response may be large; see `formats`). Made here rather than by psycopg's
    dumpers, which cost a lookup and an object each: the statements' parameters are of a
    few types only, text most of them (the dialect sends durations as interval text)."""
    return [
        value.encode(encoding)
        if type(value) is str
        else value
        if value is None or type(value) is bytes
        else b"%d" % value
        if type(value) is int
        else _literal(value)
        for value in values
    ]


def formats(values: tuple[Any, ...]) -> list[pq.Format] | None:
    """The parameters' formats: None for all text (no bytes among them)."""
    if bytes not in map(type, values):
        return None
    return [_BINARY if type(value) is bytes else _TEXT for value in values]


def _literal(value: Any) -> bytes:
    """A value of the rarer types as PostgreSQL's text input reads it."""
    if isinstance(value, timedelta):
        return pg_interval(value).encode()
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
    there, whether it prepares any (psycopg's ``prepare_threshold``, read when the session
    is first used), the client encoding it was made for, and a Transformer that loads the
    rows (cheap to keep, not to make).

    Rows come in binary. In a UTF-8 session (the usual one; SQL_ASCII is taken as one) the
    Transformer is made with no connection: it decodes text as UTF-8 and gives times in
    UTC, which is what the record's decode wants (psycopg's, made with the connection,
    gives them in the session's time zone, to be converted back: two conversions of each of
    the five times of a reservation's row)."""

    def __init__(self, conn: Any) -> None:
        self.prepared: set[bytes] = set()
        self.named = conn.prepare_threshold is not None
        self.client_encoding = conn.pgconn.parameter_status(b"client_encoding")
        # SQL_ASCII takes any bytes: text goes as UTF-8 there, as psycopg sends it, and is
        # read back as UTF-8 (psycopg would give bytes, which no record holds).
        utf8 = self.client_encoding in (b"UTF8", b"SQL_ASCII")
        self.encoding = "utf-8" if utf8 else conn.info.encoding
        self.adapt = Transformer(None if utf8 else cast(AdaptContext, _Context(conn)))


# The session of a connection, kept on it: a connection is one session for its life.
_SESSION = "_idempo_session"

# What the messages of a batch answer, in order: the index of the caller's statement (-1:
# one of this module's own: a savepoint, a rollback, a Parse), and for a prepared statement
# or its Parse, its name and whether it is the Parse.
Step = tuple[int, bytes, bool]
_OWN: Step = (-1, b"", False)

# What a statement the server skipped, after an earlier one of its batch failed, answered.
SKIPPED: Any = type("Skipped", (), {"__repr__": lambda self: "SKIPPED"})()


def exchange(conn: Any, pending: list[tuple[Any, Any]]) -> Generator[Any, Any, list[Any]]:
    """Send ``pending`` (``(sql, params)``: SQL with ``:name`` parameters and a dict of
    them, or bytes and None) in one pipeline: what each statement answered, its rows (None
    when it returns none), the error it raised, or `SKIPPED`. A generator of libpq's waits
    (psycopg's generators) for the connection's ``wait`` (sync or async) to run while its
    caller holds the connection's lock."""
    pgconn = conn.pgconn
    session: _Session | None = getattr(conn, _SESSION, None)
    if session is None or session.client_encoding != pgconn.parameter_status(b"client_encoding"):
        session = _Session(conn)
        setattr(conn, _SESSION, session)
    # Outside a transaction a failure loses nothing of anyone's: the batch starts over.
    fresh = pgconn.transaction_status == _IDLE
    first, last = (-1, -1) if fresh or not session.named else _guarded(pending)
    answers: list[Any] = [SKIPPED] * len(pending)
    plan = _Plan(pending, session, first, last)
    if not (yield from _roundtrip(pgconn, plan, 0, b"", answers)):
        return answers
    # A prepared statement had vanished (its name is forgotten now), or its Parse found it
    # there: the batch goes again, with the Parse, from where nothing is lost.
    if fresh:
        start, undo = 0, b"" if pgconn.transaction_status == _IDLE else _ROLLBACK
    else:
        start, undo = first, _BACK_TO_SAFE
    answers[start:] = [SKIPPED] * (len(pending) - start)
    yield from _roundtrip(pgconn, plan, start, undo, answers)
    return answers


def _guarded(pending: list[tuple[Any, Any]]) -> tuple[int, int]:
    """The savepoint of a batch inside a transaction: taken before its first prepared
    statement, released after its last one unless a COMMIT follows (their indexes; -1 for
    none)."""
    prepared = [i for i, (_, params) in enumerate(pending) if params is not None]
    if not prepared:
        return -1, -1
    last = prepared[-1]
    if last + 1 < len(pending) and pending[last + 1][0] == _COMMIT:
        last = -1
    return prepared[0], last


class _Plan(NamedTuple):
    """A batch: its statements, the session they go to, and the savepoint around its
    prepared statements where it runs inside a transaction (see `_guarded`)."""

    pending: list[tuple[Any, Any]]
    session: _Session
    first: int
    last: int


def _roundtrip(
    pgconn: Any, plan: _Plan, start: int, undo: bytes, answers: list[Any]
) -> Generator[Any, Any, bool]:
    """Send the batch from its statement ``start`` on in one pipeline and fill ``answers``:
    True when it must be sent again (see `_answer`)."""
    pgconn.enter_pipeline_mode()
    steps: list[Step] = []
    synced = False
    try:
        _send(pgconn, plan, start, undo, steps)
        pgconn.pipeline_sync()
        synced = True
        results = yield _communicate(pgconn, len(steps))
    except BaseException:
        yield from _abandon(pgconn, synced)
        raise
    pgconn.exit_pipeline_mode()
    return _answer(steps, results, answers, plan.session)


def _communicate(pgconn: Any, count: int) -> Generator[Any, Any, list[Any]]:
    """Flush what was sent, then read the results of ``count`` messages and the Sync's: one
    wait of the connection's (psycopg's generator protocol: yield what to wait for, receive
    what is ready). Cheaper than psycopg's generator per result. Notifications that arrive
    meanwhile go to the connection's handler, as psycopg's own reads pass them on."""
    while pgconn.flush():
        ready = yield _WAIT_RW
        if ready and ready & _READY_R:
            pgconn.consume_input()
    results: list[Any] = []
    is_busy, get_result = pgconn.is_busy, pgconn.get_result
    while True:
        if is_busy():
            if (yield _WAIT_R):
                pgconn.consume_input()
            continue
        result = get_result()
        if result is None:
            continue  # the end of one message's results
        if result.status == _PIPELINE_SYNC:
            _notified(pgconn)
            return results
        results.append(result)


def _notified(pgconn: Any) -> None:
    handler = pgconn.notify_handler
    while (notify := pgconn.notifies()) is not None:
        if handler is not None:
            handler(notify)


def _drained(pgconn: Any) -> Generator[Any, Any, None]:
    """Read what is left of a batch, up to its Sync."""
    yield from _communicate(pgconn, 0)


def _send(pgconn: Any, plan: _Plan, start: int, undo: bytes, steps: list[Step]) -> None:
    """Send the batch from its statement ``start`` on, noting each message in ``steps``:
    ``undo`` first (what undoes a failed try), each prepared statement's Parse before its
    first use in the session, and the savepoint around the prepared statements (see
    `_guarded`). A retry keeps the savepoint: a rollback to it keeps it."""
    send_params = pgconn.send_query_params
    if undo:
        send_params(undo, None, None, None, _BINARY)
        steps.append(_OWN)
    pending, session, first, last = plan
    encoding, prepared, named = session.encoding, session.prepared, session.named
    for i in range(start, len(pending)):
        sql, params = pending[i]
        if params is None:
            send_params(sql, None, None, None, _BINARY)
            steps.append((i, b"", False))
            continue
        if i == first and not undo:
            send_params(_SAFE, None, None, None, _BINARY)
            steps.append(_OWN)
        query, name, take = compiled(sql)
        values = take(params)
        if not named:
            send_params(query, dumped(values, encoding), None, formats(values), _BINARY)
            steps.append((i, b"", False))
            continue
        if name not in prepared:
            pgconn.send_prepare(name, query)
            steps.append((-1, name, True))
        pgconn.send_query_prepared(name, dumped(values, encoding), formats(values), _BINARY)
        steps.append((i, name, False))
        if i == last:
            send_params(_SAFE_DONE, None, None, None, _BINARY)
            steps.append(_OWN)


def _answer(steps: list[Step], results: list[Any], answers: list[Any], session: _Session) -> bool:
    """Fill ``answers`` from the results: True when the batch must be sent again because a
    prepared statement had vanished (or, its Parse says, was there already)."""
    adapt = session.adapt
    for i, result in enumerate(results):
        status = result.status
        if status == _TUPLES_OK:
            at = steps[i][0]
            if at >= 0:
                adapt.set_pgresult(result)
                answers[at] = adapt.load_rows(0, result.ntuples, tuple)
        elif status == _FATAL_ERROR:
            return _failed(steps, i, result, answers, session)
        elif status != _ABORTED:
            at, name, parse = steps[i]
            if at >= 0:
                answers[at] = None
            elif parse:
                session.prepared.add(name)
    return False


def _failed(steps: list[Step], i: int, result: Any, answers: list[Any], session: _Session) -> bool:
    """Record the error of the batch's message ``i``: True when it is a prepared statement's
    name gone from the session, or found there by its Parse (the batch is sent again)."""
    at, name, parse = steps[i]
    if at < 0:  # one of this module's own: the error is the next statement's
        at = next((step[0] for step in steps[i:] if step[0] >= 0), -1)
    answers[at] = pg_errors.error_from_result(result, encoding=session.encoding)
    state = result.error_field(_SQLSTATE)
    if parse and state == _EXISTS:
        session.prepared.add(name)
        return True
    if name and not parse and state == _MISSING:
        session.prepared.discard(name)
        return True
    return False


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
                yield _drained(pgconn)
                pgconn.exit_pipeline_mode()
            return
    except BaseException:  # noqa: BLE001, S110 - closed below: its state is unknown
        pass
    pgconn.finish()
