"""`idempo demo`: a storm of concurrent duplicate retries against a guarded payment function.

Each intent (one payment a customer wants) is sent by several concurrent callers with the
same key, as a client retrying after timeouts would. Some intents are first met by a
transient failure, some by a caller that reuses the key with another amount, and the work
holds its key long enough that duplicates arrive while it is in flight. The business write
(a payment row, in a table with no unique constraint, so a double charge would show) commits
with the idempotency record in the app's own transaction.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from .errors import FingerprintMismatchError, RequestInProgressError
from .guard import Idempotency
from .policy import Policy
from .stores import open_store

OPERATION = "demo.charge"


class TransientError(Exception):
    """The simulated payment provider timed out; nothing was charged, a retry may run again."""


@dataclass
class Tally:
    """What the storm did, counted as it happened."""

    calls: int = 0
    executions: int = 0
    replays: int = 0
    conflicts: int = 0
    in_progress: int = 0
    transient: int = 0
    answers: dict[str, set[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def answer(self, intent: str, payment_id: str) -> None:
        with self.lock:
            self.answers.setdefault(intent, set()).add(payment_id)


@dataclass(frozen=True)
class Report:
    """The outcome: exactly-once held if every intent was charged once and answered alike."""

    intents: int
    tally: Tally
    charges: Counter[str]

    @property
    def double_charges(self) -> int:
        return sum(1 for count in self.charges.values() if count > 1)

    @property
    def missing(self) -> int:
        return sum(1 for intent in self.tally.answers if self.charges[intent] == 0)

    @property
    def inconsistent(self) -> int:
        return sum(1 for ids in self.tally.answers.values() if len(ids) != 1)

    @property
    def exactly_once(self) -> bool:
        charged = sum(1 for count in self.charges.values() if count == 1)
        return (
            self.double_charges == 0
            and self.missing == 0
            and self.inconsistent == 0
            and charged == self.intents
        )


class _App:
    """The example app: a payments table next to the idempotency records."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.store: Any = open_store(url)
        self.store.migrate()
        # The payments live next to the records (same schema), so one URL is the whole state.
        schema, _, _ = self.store.dialect.table.rpartition(".")
        self.payments = f"{schema}.demo_payments" if schema else "demo_payments"
        self._local = threading.local()
        self._connections: list[Any] = []
        self._lock = threading.Lock()
        with self.connection() as conn:
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self.payments}"
                " (payment_id TEXT NOT NULL, intent TEXT NOT NULL, amount INTEGER NOT NULL)"
            )
            conn.commit()

    def connect(self) -> Any:
        if self.url.startswith("sqlite"):
            return self.store.connect()
        import psycopg  # noqa: PLC0415 - only for a PostgreSQL demo

        return psycopg.connect(self.url.split("?", 1)[0])

    @contextmanager
    def connection(self) -> Iterator[Any]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self.connect()
            with self._lock:
                self._connections.append(conn)
        yield conn

    def close(self) -> None:
        for conn in self._connections:
            conn.close()
        self.store.close()

    def charges(self) -> Counter[str]:
        with self.connection() as conn:
            rows = conn.execute(f"SELECT intent FROM {self.payments}").fetchall()
            conn.rollback()
        return Counter(intent for (intent,) in rows)

    def param(self) -> str:
        return "?" if self.url.startswith("sqlite") else "%s"


def _caller(
    idem: Idempotency,
    app: _App,
    tally: Tally,
    intent: str,
    amount: int,
    work_seconds: float,
    flaky: set[str],
) -> None:
    """One client: retries its intent with the same key until it gets the answer."""
    p = app.param()
    insert = f"INSERT INTO {app.payments} (payment_id, intent, amount) VALUES ({p}, {p}, {p})"
    while True:
        tally.add(calls=1)
        try:
            with (
                app.connection() as conn,
                idem.once(
                    intent,
                    operation=OPERATION,
                    payload={"amount": amount},
                    conn=conn,
                    mode="leased",
                ) as attempt,
            ):
                if not attempt.replayed:
                    tally.add(executions=1)
                    payment_id = str(uuid.uuid4())
                    conn.execute(insert, (payment_id, intent, amount))
                    time.sleep(work_seconds)  # duplicates arrive while this is in flight
                    with tally.lock:
                        fail_now = intent in flaky
                        flaky.discard(intent)
                    if fail_now:
                        raise TransientError(intent)
                    attempt.result = {"payment_id": payment_id, "amount": amount}
        except RequestInProgressError as exc:
            tally.add(in_progress=1)
            time.sleep(min(exc.retry_after, 0.01) * random.uniform(0.5, 1.5))
            continue
        except TransientError:
            tally.add(transient=1)
            continue
        except FingerprintMismatchError:
            tally.add(conflicts=1)
            return
        if attempt.replayed:
            tally.add(replays=1)
        tally.answer(intent, attempt.result["payment_id"])
        return


def run_storm(
    url: str | None = None,
    *,
    intents: int = 200,
    retries: int = 4,
    concurrency: int = 16,
    work_seconds: float = 0.005,
    on_progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Run the storm and report. ``url`` defaults to a fresh SQLite file."""
    if url is None:
        url = f"sqlite:///{Path(tempfile.mkdtemp(prefix='idempo-demo-')) / 'demo.db'}"
    app = _App(url)
    idem = Idempotency(app.store, Policy(lease=timedelta(seconds=10)))
    try:
        return _storm(app, idem, intents, retries, concurrency, work_seconds, on_progress)
    finally:
        app.close()


def _storm(
    app: _App,
    idem: Idempotency,
    intents: int,
    retries: int,
    concurrency: int,
    work_seconds: float,
    on_progress: Callable[[int, int], None] | None,
) -> Report:
    rng = random.Random(1)
    names = [f"intent-{uuid.uuid4()}" for _ in range(intents)]
    flaky = {name for name in names if rng.random() < 0.1}
    jobs: list[tuple[str, int]] = []
    for name in names:
        amount = rng.randint(100, 100_000)
        jobs += [(name, amount)] * retries
        if rng.random() < 0.05:
            jobs.append((name, amount + 1))  # a client bug: same key, another payload
    rng.shuffle(jobs)
    tally = Tally()
    done = 0
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [
            pool.submit(_caller, idem, app, tally, name, amount, work_seconds, flaky)
            for name, amount in jobs
        ]
        for future in futures:
            future.result()
            done += 1
            if on_progress:
                on_progress(done, len(futures))
    wanted = set(names)  # a reused store may hold earlier runs' payments
    charges = Counter({k: n for k, n in app.charges().items() if k in wanted})
    return Report(intents=intents, tally=tally, charges=charges)
