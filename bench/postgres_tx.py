"""Throughput and round trips of idempotent PostgreSQL transactions, measured in one run.

Scenarios, each on its own dedicated connection(s):

    bare                  BEGIN; one-row business INSERT; COMMIT
    bare_select           primary-key SELECT of an existing row (the baseline for replays)
    handwritten           the idempotency pattern by hand: reserve key, insert, complete
    handwritten_pipeline  the same statements in psycopg pipeline mode (2 round trips)
    handwritten_replay    replay of a completed key by hand: one SELECT
    idemkit               the peer library idemkit (PyPI), used as its README shows
    idemkit_replay        idemkit replaying an already-completed key
    idempo                this library, transactional mode on the app's connection
    idempo_replay         idempo replaying an already-completed key
    idempo_leased         leased mode on the app's connection (reservation commits first)
    idempo_store          leased mode on the store's own connections (no shared transaction)
    *_replay              the same mode replaying an already-completed key

Scenarios run in interleaved rounds with a rotating order, and the table reports the median
ops/s, so one noisy moment on a shared machine does not decide a ratio. Round trips are
counted in a separate phase through a loopback proxy (bench/_roundtrips.py): the proxy adds
latency of its own and must never touch the timed numbers. Where the server runs on this
host, its CPU time over each scenario's timed calls (all its processes, the WAL writer's
too, from /proc) is shown per call: what a call costs the server every client shares.

``--instructions`` counts instead the CPU instructions one call costs the client process
(Python, psycopg, libpq; not the server), under valgrind (callgrind), from two runs of 100 and
400 calls differenced, so start-up and warm-up cancel out: a measure that load on a shared
machine does not move.

Usage: python bench/postgres_tx.py [--seconds N] [--quick] [--rounds R] [--dsn URL]
       python bench/postgres_tx.py --instructions [--only NAME ...]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg.types.json import Jsonb

from _measure import callgrind_count, server_cpu_ns
from _report import report, report_instructions
from _roundtrips import RoundTripProxy

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
PAYMENTS_TABLE = "bench_payments"
KEYS_TABLE = "bench_keys"
IDEMKIT_TABLE = "bench_idemkit_records"
IDEMPO_TABLE = "bench_idempo_records"
AMOUNT = 100
OPERATION = "bench.pay"

INSERT_PAYMENT = f"INSERT INTO {PAYMENTS_TABLE} (id, amount) VALUES (%s, %s)"
SELECT_PAYMENT = f"SELECT id, amount, created_at FROM {PAYMENTS_TABLE} WHERE id = %s"
RESERVE_KEY = (
    f"INSERT INTO {KEYS_TABLE} (key, operation) VALUES (%s, %s) "
    "ON CONFLICT DO NOTHING RETURNING key"
)
COMPLETE_KEY = f"UPDATE {KEYS_TABLE} SET response = %s WHERE key = %s"
SELECT_KEY = f"SELECT response FROM {KEYS_TABLE} WHERE key = %s"

# One id per run keeps fresh keys unique even if a previous run was killed before cleanup.
RUN_ID = secrets.token_hex(4)
_serial = itertools.count()


def fresh_key(scenario: str) -> str:
    return f"{RUN_ID}-{scenario}-{next(_serial)}"


# --------------------------------------------------------------------------- scenarios


@dataclass
class Scenario:
    """One measured operation plus the resources it holds."""

    name: str
    op: Callable[[], None]
    close: Callable[[], None]


ScenarioFactory = Callable[[str], Scenario]


def make_bare(dsn: str) -> Scenario:
    conn = psycopg.connect(dsn)

    def op() -> None:
        with conn.transaction():
            conn.execute(INSERT_PAYMENT, (fresh_key("bare"), AMOUNT))

    return Scenario("bare", op, conn.close)


def make_bare_select(dsn: str) -> Scenario:
    conn = psycopg.connect(dsn, autocommit=True)
    payment_id = fresh_key("bare_select")
    conn.execute(INSERT_PAYMENT, (payment_id, AMOUNT))

    def op() -> None:
        if conn.execute(SELECT_PAYMENT, (payment_id,)).fetchone() is None:
            raise RuntimeError("seeded payment vanished")

    return Scenario("bare_select", op, conn.close)


def handwritten_pay(conn: psycopg.Connection[Any], key: str) -> None:
    """The pattern by hand: reserve the key, do the work, store the response, all in one tx."""
    with conn.transaction():
        if conn.execute(RESERVE_KEY, (key, OPERATION)).fetchone() is None:
            raise RuntimeError(f"fresh key {key} was already reserved")
        conn.execute(INSERT_PAYMENT, (key, AMOUNT))
        conn.execute(COMPLETE_KEY, (Jsonb({"id": key}), key))


def make_handwritten(dsn: str) -> Scenario:
    conn = psycopg.connect(dsn)
    return Scenario("handwritten", lambda: handwritten_pay(conn, fresh_key("hw")), conn.close)


def handwritten_pipeline_pay(conn: psycopg.Connection[Any], key: str) -> None:
    """The same statements in two round trips: BEGIN + reserve, then the rest + COMMIT.

    The connection is in autocommit mode and BEGIN/COMMIT are plain statements, because
    psycopg's own transaction handling syncs the pipeline around BEGIN and COMMIT, which
    would cost extra round trips.
    """
    with conn.pipeline() as pipeline:
        conn.execute("BEGIN")
        reserved = conn.execute(RESERVE_KEY, (key, OPERATION))
        pipeline.sync()
        if reserved.fetchone() is None:
            conn.execute("ROLLBACK")
            raise RuntimeError(f"fresh key {key} was already reserved")
        conn.execute(INSERT_PAYMENT, (key, AMOUNT))
        conn.execute(COMPLETE_KEY, (Jsonb({"id": key}), key))
        conn.execute("COMMIT")
    # Leaving the pipeline block sends the second batch and waits for its results.


def make_handwritten_pipeline(dsn: str) -> Scenario:
    conn = psycopg.connect(dsn, autocommit=True)
    return Scenario(
        "handwritten_pipeline",
        lambda: handwritten_pipeline_pay(conn, fresh_key("hwp")),
        conn.close,
    )


def make_handwritten_replay(dsn: str) -> Scenario:
    conn = psycopg.connect(dsn, autocommit=True)
    key = fresh_key("hw_replay")
    handwritten_pay(conn, key)

    def op() -> None:
        row = conn.execute(SELECT_KEY, (key,)).fetchone()
        if row is None or row[0] != {"id": key}:
            raise RuntimeError(f"completed key {key} did not replay its response")

    return Scenario("handwritten_replay", op, conn.close)


# --------------------------------------------------------------------------- idemkit


def make_idemkit_pay(dsn: str) -> tuple[Callable[..., Any], Callable[[], None]]:
    """Wrap a one-row business insert the way idemkit's README shows for function calls.

    README, "Method calls and AI tools":
        @idempotent(backend=RedisBackend.from_url("redis://..."),
                    config=MethodConfig(key_fields=["order_id", "amount"]))
        async def refund(*, order_id, amount): ...
        "Sync code uses idempotent_sync"
    and, under "Backends": PostgresBackend(table="idempotency_keys") / from_url for a
    custom table. Every idemkit connection (an asyncpg pool) is opened from `dsn`, so a
    proxied `dsn` counts all of them.
    """
    import asyncpg  # noqa: F401  (PostgresBackend needs the `postgres` extra; fail early)
    from idemkit import MethodConfig, PostgresBackend, idempotent_sync
    from idemkit.core.sync_bridge import run_sync

    backend = PostgresBackend.from_url(dsn, table=IDEMKIT_TABLE)
    conn = psycopg.connect(dsn)

    with warnings.catch_warnings():
        # The bench is single-tenant on purpose; idemkit warns once when no scope is set.
        warnings.filterwarnings("ignore", message=".*has no scope.*")

        @idempotent_sync(backend=backend, config=MethodConfig(key_fields=["payment_id", "amount"]))
        def pay(*, payment_id: str, amount: int) -> dict[str, str]:
            with conn.transaction():
                conn.execute(INSERT_PAYMENT, (payment_id, amount))
            return {"id": payment_id}

    def close() -> None:
        # The asyncpg pool lives on idemkit's background loop and must be closed there.
        run_sync(backend.aclose())
        conn.close()

    return pay, close


def create_idemkit_table(dsn: str) -> None:
    """What `idemkit init-pg <url> --table <name>` runs."""
    from idemkit.backends.postgres import init_pg

    asyncio.run(init_pg(dsn, table=IDEMKIT_TABLE))


def make_idemkit(dsn: str) -> Scenario:
    pay, close = make_idemkit_pay(dsn)

    def op() -> None:
        key = fresh_key("idemkit")
        if pay(payment_id=key, amount=AMOUNT) != {"id": key}:
            raise RuntimeError("idemkit returned an unexpected result")

    return Scenario("idemkit", op, close)


def make_idemkit_replay(dsn: str) -> Scenario:
    pay, close = make_idemkit_pay(dsn)
    key = fresh_key("idemkit_replay")
    pay(payment_id=key, amount=AMOUNT)

    def op() -> None:
        # Had idemkit run the body again, the duplicate business row would raise here.
        if pay(payment_id=key, amount=AMOUNT) != {"id": key}:
            raise RuntimeError("idemkit replay returned an unexpected result")

    return Scenario("idemkit_replay", op, close)


# --------------------------------------------------------------------------- idempo


@dataclass
class IdempoGuard:
    """idempo's guard, its store, and the app connection it runs transactions on."""

    idem: Any
    store: Any
    conn: psycopg.Connection[Any]

    def close(self) -> None:
        close_store = getattr(self.store, "close", None)
        if callable(close_store):
            close_store()
        self.conn.close()


def make_idempo_guard(dsn: str) -> IdempoGuard:
    """idempo on its own store; the app connection is a default psycopg connection
    (autocommit off), like `bare`'s."""
    from idempo import Idempotency
    from idempo.stores.postgres import PostgresStore

    store = PostgresStore(dsn, table=IDEMPO_TABLE)
    store.migrate()
    return IdempoGuard(Idempotency(store), store, psycopg.connect(dsn))


def idempo_pay(idem: Any, conn: psycopg.Connection[Any], key: str, mode: str) -> Any:
    """One guarded call on the app's connection. With ``mode="store"`` the guard runs on the
    store's own connections and the business insert commits by itself (no shared transaction);
    otherwise the guard owns the transaction on ``conn`` in the given mode."""
    on_conn = {} if mode == "store" else {"conn": conn, "mode": mode}
    with idem.once(key, operation=OPERATION, payload={"amount": AMOUNT}, **on_conn) as attempt:
        if not attempt.replayed:
            conn.execute(INSERT_PAYMENT, (key, AMOUNT))
            if mode == "store":
                conn.commit()
            attempt.result = {"id": key}
    return attempt


def idempo_fresh(idem: Any, conn: psycopg.Connection[Any], key: str, mode: str) -> None:
    """A fresh key must run the body once and not replay."""
    if idempo_pay(idem, conn, key, mode).replayed:
        raise RuntimeError(f"idempo replayed fresh key {key}")


def idempo_replay(idem: Any, conn: psycopg.Connection[Any], key: str, mode: str) -> None:
    """A completed key must replay its stored result without running the body."""
    attempt = idempo_pay(idem, conn, key, mode)
    if not attempt.replayed or attempt.result != {"id": key}:
        raise RuntimeError(f"idempo did not replay completed key {key}")


def idempo_factories(mode: str) -> tuple[ScenarioFactory, ScenarioFactory]:
    """Fresh-key and replay scenarios for one mode."""
    suffix = "" if mode == "transactional" else f"_{mode}"

    def fresh(dsn: str) -> Scenario:
        guard = make_idempo_guard(dsn)
        name = f"idempo{suffix}"
        return Scenario(
            name,
            lambda: idempo_fresh(guard.idem, guard.conn, fresh_key(name), mode),
            guard.close,
        )

    def replay(dsn: str) -> Scenario:
        guard = make_idempo_guard(dsn)
        name = f"idempo{suffix}_replay"
        key = fresh_key(name)
        idempo_fresh(guard.idem, guard.conn, key, mode)
        return Scenario(name, lambda: idempo_replay(guard.idem, guard.conn, key, mode), guard.close)

    return fresh, replay


make_idempo, make_idempo_replay = idempo_factories("transactional")
make_idempo_leased, make_idempo_leased_replay = idempo_factories("leased")
make_idempo_store, make_idempo_store_replay = idempo_factories("store")


# Order is the table's order; "kind" says what one op is when reading round trips.
FACTORIES: dict[str, tuple[str, ScenarioFactory]] = {
    "bare": ("write tx", make_bare),
    "bare_select": ("read", make_bare_select),
    "handwritten": ("fresh", make_handwritten),
    "handwritten_pipeline": ("fresh", make_handwritten_pipeline),
    "handwritten_replay": ("replay", make_handwritten_replay),
    "idemkit": ("fresh", make_idemkit),
    "idemkit_replay": ("replay", make_idemkit_replay),
    "idempo": ("fresh", make_idempo),
    "idempo_replay": ("replay", make_idempo_replay),
    "idempo_leased": ("fresh", make_idempo_leased),
    "idempo_leased_replay": ("replay", make_idempo_leased_replay),
    "idempo_store": ("fresh", make_idempo_store),
    "idempo_store_replay": ("replay", make_idempo_store_replay),
}

RATIOS: list[tuple[str, str]] = [
    ("idempo", "handwritten"),
    ("idempo", "bare"),
    ("idempo_replay", "bare_select"),
    ("idempo_leased", "bare"),
    ("idempo_leased_replay", "bare_select"),
    ("idempo_store_replay", "bare_select"),
    ("idempo", "idemkit"),
    ("idempo_replay", "idemkit_replay"),
    ("handwritten", "bare"),
    ("handwritten_pipeline", "bare"),
    ("idemkit", "bare"),
    ("idemkit_replay", "bare_select"),
]


# --------------------------------------------------------------------------- schema


def create_schema(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {PAYMENTS_TABLE}, {KEYS_TABLE}")
        conn.execute(
            f"CREATE TABLE {PAYMENTS_TABLE} (id text PRIMARY KEY, amount int NOT NULL,"
            " created_at timestamptz NOT NULL DEFAULT now())"
        )
        conn.execute(
            f"CREATE TABLE {KEYS_TABLE} (key text PRIMARY KEY, operation text NOT NULL,"
            " response jsonb, created_at timestamptz NOT NULL DEFAULT now())"
        )


def drop_schema(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"DROP TABLE IF EXISTS {PAYMENTS_TABLE}, {KEYS_TABLE}, {IDEMKIT_TABLE}, {IDEMPO_TABLE}"
        )
        # idempo's reservation function and token sequence (`migrate` makes them; they
        # outlive their table, so that a table made again never hands out a token twice).
        conn.execute(f"DROP FUNCTION IF EXISTS {IDEMPO_TABLE}_reserve")
        conn.execute(f"DROP SEQUENCE IF EXISTS {IDEMPO_TABLE}_tokens")


# --------------------------------------------------------------------------- measuring


@dataclass
class Result:
    kind: str
    ops_per_s: list[float] = field(default_factory=list)
    round_trips: float | None = None
    # The server's CPU time over the timed calls (every postgres process of this host), and
    # those calls' number: None when the server is not on this host.
    server_ns: int | None = 0
    calls: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.ops_per_s)

    @property
    def server_us(self) -> float | None:
        """The server's CPU time per call, in µs."""
        if self.server_ns is None or not self.calls:
            return None
        return self.server_ns / self.calls / 1000


def run_for(scenario: Scenario, seconds: float) -> tuple[int, float]:
    """Run one scenario back to back for `seconds`; return its calls and their seconds."""
    ops = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        scenario.op()
        ops += 1
        now = time.perf_counter()
        if now >= deadline:
            return ops, now - start


def warm_up(scenario: Scenario, ops: int) -> None:
    # Fills statement caches (psycopg prepares after 5 runs, asyncpg per pooled connection).
    for _ in range(ops):
        scenario.op()


def rotations(scenarios: list[Scenario], rounds: int) -> Iterator[list[Scenario]]:
    """Each round starts one scenario later, so none always runs first or after the same one."""
    for r in range(rounds):
        shift = r % len(scenarios)
        yield scenarios[shift:] + scenarios[:shift]


def measure_throughput(
    scenarios: list[Scenario], results: dict[str, Result], rounds: int, slice_s: float
) -> None:
    for order in rotations(scenarios, rounds):
        for scenario in order:
            result = results[scenario.name]
            before = server_cpu_ns("postgres")
            ops, seconds = run_for(scenario, slice_s)
            after = server_cpu_ns("postgres")
            result.ops_per_s.append(ops / seconds)
            result.calls += ops
            if before is None or after is None or result.server_ns is None:
                result.server_ns = None
            else:
                result.server_ns += after - before


def with_port(dsn: str, port: int) -> str:
    parts = urlsplit(dsn)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{port}"
    netloc_out = f"{netloc[0]}@{host}" if len(netloc) == 2 else host
    return urlunsplit(parts._replace(netloc=netloc_out))


def count_round_trips(
    factory: ScenarioFactory, proxy: RoundTripProxy, dsn: str, ops: int, warmup: int
) -> float:
    """Per-op round trips, connection setup and warm-up excluded, nothing subtracted."""
    scenario = factory(with_port(dsn, proxy.port))
    try:
        warm_up(scenario, warmup)
        settle()
        proxy.reset()
        for _ in range(ops):
            scenario.op()
        settle()
        return proxy.round_trips / ops
    finally:
        scenario.close()


def settle() -> None:
    # Lets the proxy thread see any trailing client bytes before the counter is read.
    time.sleep(0.05)


# --------------------------------------------------------------------------- reporting


def server_version(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"


def print_header(dsn: str, rounds: int, slice_s: float, count_ops: int) -> None:
    print(
        f"PostgreSQL {server_version(dsn)}, psycopg {psycopg.__version__}, "
        f"python {sys.version.split()[0]}"
    )
    print(
        f"{rounds} interleaved rounds x {slice_s:.2f} s per scenario; "
        f"round trips averaged over {count_ops} ops through a counting proxy\n"
    )


def print_table(results: dict[str, Result]) -> None:
    print(
        f"{'scenario':<22}{'kind':<10}{'ops/s':>9}{'min':>9}{'max':>9}{'RT/op':>8}"
        f"{'server us/op':>14}"
    )
    for name, result in results.items():
        rt = f"{result.round_trips:.2f}" if result.round_trips is not None else "-"
        server = f"{result.server_us:.1f}" if result.server_us is not None else "-"
        print(
            f"{name:<22}{result.kind:<10}{result.median:>9.0f}"
            f"{min(result.ops_per_s):>9.0f}{max(result.ops_per_s):>9.0f}{rt:>8}{server:>14}"
        )


# Issue 15's goals for the ratios that have one.
GOALS = {
    ("idempo", "bare"): 0.65,
    ("idempo_store_replay", "bare_select"): 0.8,
    ("idempo", "idemkit"): 1.0,
    ("idempo_replay", "idemkit_replay"): 1.0,
}


def print_ratios(results: dict[str, Result]) -> None:
    print("\nratios of median ops/s (same run):")
    for top, bottom in RATIOS:
        label = f"{top} / {bottom}"
        if top in results and bottom in results:
            ratio = results[top].median / results[bottom].median
            goal = GOALS.get((top, bottom))
            report("postgres", label, ratio, goal, round_trips=results[top].round_trips)
            print(f"  {label:<40}{ratio:>7.2f}")
        else:
            print(f"  {label:<40}{'n/a':>7}")


# The server's CPU per call that `make bench` reports, each beside its baseline's.
SERVER_ROWS = [
    ("idempo", "bare"),
    ("idempo_store_replay", "bare_select"),
]


def print_server(results: dict[str, Result]) -> None:
    """The server's CPU time per call against the baseline's: what a call costs the one
    server every client shares, which the throughput ratios above hide behind the round
    trip's latency."""
    rows = []
    for top, bottom in SERVER_ROWS:
        if top in results and bottom in results:
            top_us, bottom_us = results[top].server_us, results[bottom].server_us
            if top_us is None or bottom_us is None:
                print("\nserver CPU per call: not measured (the server is not on this host)")
                return
            rows.append((top, bottom, top_us, bottom_us))
    print("\nserver CPU per call (every postgres process of this host), µs:")
    for top, bottom, top_us, bottom_us in rows:
        label = f"{top} / {bottom}"
        print(f"  {label:<40}{top_us:>7.1f} / {bottom_us:.1f} = {top_us / bottom_us:.2f}x")
        path = f"server CPU per call, µs: {top} ({bottom}: {bottom_us:.1f})"
        report("postgres", path, top_us, None, unit="")


# --------------------------------------------------------------------------- main


@dataclass
class Settings:
    dsn: str
    seconds: float
    rounds: int
    count_ops: int
    warmup: int
    instructions: bool = False
    only: tuple[str, ...] = ()
    scenario: str | None = None  # the one scenario a callgrind child runs
    calls: int = 0


def parse_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="PostgreSQL URL (default: %(default)s)")
    parser.add_argument(
        "--seconds", type=float, help="total timed seconds, split over all rounds and scenarios"
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds per scenario")
    parser.add_argument("--quick", action="store_true", help="short run (~40 s)")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="instead: client CPU instructions per call of each scenario, under valgrind",
    )
    parser.add_argument("--only", nargs="+", choices=FACTORIES, default=INSTRUCTION_SCENARIOS)
    parser.add_argument("--scenario", choices=FACTORIES, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    modes = {"instructions": args.instructions, "only": tuple(args.only)}
    modes |= {"scenario": args.scenario, "calls": args.calls}
    if args.quick:
        # Six rounds, not three: every write scenario ends in a commit's fdatasync, whose
        # time spreads by more than 2x round to round on these disks, and the median of
        # three rounds moved the transactional row from 0.27 to 0.69 within an hour.
        return Settings(args.dsn, args.seconds or 30.0, args.rounds or 6, 20, 10, **modes)
    return Settings(args.dsn, args.seconds or 90.0, args.rounds or 5, 50, 20, **modes)


# --------------------------------------------------------------------------- instructions

# Calls in the two runs whose difference is measured: start-up and warm-up cancel out.
INSTRUCTION_CALLS = (100, 400)
INSTRUCTION_SCENARIOS = [
    "bare",
    "bare_select",
    "idempo",
    "idempo_replay",
    "idempo_store",
    "idempo_store_replay",
]
INSTRUCTION_RATIOS = [
    ("idempo", "bare"),
    ("idempo_replay", "bare_select"),
    ("idempo_store_replay", "bare_select"),
]


def run_one(settings: Settings) -> None:
    """The process valgrind watches: build one scenario, warm it up, make the calls."""
    assert settings.scenario is not None
    counted_calls(FACTORIES[settings.scenario][1](settings.dsn), settings.calls)


def counted_calls(scenario: Scenario, calls: int) -> None:
    """What a process valgrind watches does: warm ``scenario`` up, make ``calls`` calls,
    close it (bench/redis_store.py's too)."""
    try:
        warm_up(scenario, 50)
        for _ in range(calls):
            scenario.op()
    finally:
        scenario.close()


def print_instructions(settings: Settings) -> None:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--instructions needs valgrind")
    low, high = INSTRUCTION_CALLS
    print(f"client instructions per call (callgrind; runs of {low} and {high} calls, differenced)")
    counts: dict[str, float] = {}
    for name in settings.only:
        runs = []
        for calls in (low, high):
            args = ["--dsn", settings.dsn, "--scenario", name, "--calls", str(calls)]
            runs.append(callgrind_count(valgrind, __file__, args))
        counts[name] = (runs[1] - runs[0]) / (high - low)
        print(f"  {name:<22}{counts[name] / 1000:>9.0f} k")
    for top, bottom in INSTRUCTION_RATIOS:
        if top in counts and bottom in counts:
            print(f"  {top} / {bottom}: {counts[top] / counts[bottom]:.2f}x the instructions")
            report_instructions("postgres", top, bottom, counts)


def build_available(dsn: str, notes: list[str]) -> list[Scenario]:
    """Build every scenario that can run; one whose library is missing becomes a note."""
    scenarios = []
    for name, (_, factory) in FACTORIES.items():
        try:
            scenarios.append(factory(dsn))
        except Exception as exc:
            notes.append(f"{name}: not available ({type(exc).__name__}: {exc})")
    return scenarios


def run(settings: Settings) -> None:
    notes: list[str] = []
    try:
        create_idemkit_table(settings.dsn)
    except Exception as exc:
        notes.append(f"idemkit schema: not created ({type(exc).__name__}: {exc})")
    scenarios = build_available(settings.dsn, notes)
    results = {s.name: Result(FACTORIES[s.name][0]) for s in scenarios}
    slice_s = settings.seconds / (settings.rounds * len(scenarios))
    print_header(settings.dsn, settings.rounds, slice_s, settings.count_ops)
    try:
        for scenario in scenarios:
            warm_up(scenario, settings.warmup)
        measure_throughput(scenarios, results, settings.rounds, slice_s)
    finally:
        for scenario in scenarios:
            scenario.close()

    with RoundTripProxy() as proxy:
        for name, result in results.items():
            result.round_trips = count_round_trips(
                FACTORIES[name][1], proxy, settings.dsn, settings.count_ops, settings.warmup
            )

    print_table(results)
    print_ratios(results)
    print_server(results)
    if notes:
        print()
    for note in notes:
        print(note)


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    if settings.scenario is not None:
        run_one(settings)  # the schema is the parent's
        return
    create_schema(settings.dsn)
    try:
        if settings.instructions:
            print_instructions(settings)
        else:
            run(settings)
    finally:
        drop_schema(settings.dsn)


if __name__ == "__main__":
    main()
