"""Calls/s and round trips of idempotent function calls on Redis, measured in one run.

Every scenario wraps the same trivial function, ``pay(order_id, amount) -> {"id": order_id}``,
so what is measured is the idempotency layer and its Redis traffic:

    minimum              redis-py by hand: SET key NX PX (reserve), run, SET key result PX
    minimum_replay       a completed key: GET, decode the stored result (a guard that did
                         not know the key was done would need SET NX first: 2 round trips)
    idempo               Idempotency(RedisStore).idempotent, a fresh key per call
    idempo_replay        the same, one completed key
    minimum_async_replay minimum_replay on redis.asyncio, a loop running each call
    idempo_async         AsyncIdempotency(AsyncRedisStore), a fresh key per call, likewise
    idempo_async_replay  the same, one completed key
    idempo_cached        the same guard on CachedStore(RedisStore), fresh keys
    idempo_cached_replay ... replaying from the local cache
    powertools           AWS Lambda Powertools' idempotent_function with its Redis
                         persistence layer (CachePersistenceLayer), as its docs show
    powertools_replay
    idemkit              idemkit's idempotent_sync with its RedisBackend, as its README shows
    idemkit_replay

Scenarios run in interleaved rounds with a rotating order and the table reports the median
calls/s, so one noisy moment on a shared machine does not decide a ratio. Round trips are
counted in a separate phase through a loopback proxy (bench/_roundtrips.py) that relays every
connection each library opens; the proxy adds latency of its own and never touches the timed
numbers. "CPU us" is this process's CPU time per call (all its threads), measured apart: on a
loaded machine it moves less than calls/s do. Every key lives under a prefix of this run's
own, deleted at the end. The shared measuring code is postgres_tx.py's.

The server's side is measured apart too, per scenario: ``INFO commandstats`` deltas over a
few thousand calls (reset with ``CONFIG RESETSTAT`` first, so run it on a Redis nothing else
uses): each command the scenario sent and those its scripts ran, with their ``usec_per_call``,
and the Redis time per guarded call, counting only the commands the client sent (a script's
time includes the commands it runs). "main thread" is Redis's own CPU time per call from
``INFO cpu`` (used_cpu_*_main_thread), which adds reading and writing the sockets.

``--instructions`` counts instead the CPU instructions each call costs the client process,
under valgrind (callgrind), from two runs of 200 and 1200 calls: a measure that stays the same
on a busy machine, where calls/s do not.

Usage: python bench/redis_store.py [--seconds N] [--rounds R] [--quick] [--url URL]
       python bench/redis_store.py --instructions
       python bench/redis_store.py --server-only     (the commandstats phase alone)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import secrets
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis

from _report import report, report_instructions
from _roundtrips import RoundTripProxy
from postgres_tx import (
    Result,
    Scenario,
    ScenarioFactory,
    count_round_trips,
    counted_calls,
    measure_throughput,
    warm_up,
)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
AMOUNT = 100
LEASE_MS = 30_000
TTL_MS = 24 * 3600 * 1000

# One id per run keeps keys unique even if a previous run was killed before cleanup. The
# processes valgrind watches (--instructions) take their parent's, which deletes their keys.
RUN_ID = os.environ.get("IDEMPO_BENCH_RUN_ID") or secrets.token_hex(4)
PREFIX = f"idempo-bench-{RUN_ID}"
_serial = itertools.count()


def fresh_key(scenario: str) -> str:
    return f"{scenario}-{next(_serial)}"


def pay_result(order_id: str) -> dict[str, str]:
    return {"id": order_id}


def expect(result: Any, key: str, what: str) -> None:
    if result != {"id": key}:
        raise RuntimeError(f"{what} returned {result!r} for {key}")


# --------------------------------------------------------------------------- minimum


def minimum_pay(client: redis.Redis, order_id: str, amount: int) -> dict[str, str]:
    """The least a correct Redis guard does: reserve atomically, run, store the result.

    A replay is one GET; a key found in progress is refused (the caller retries later).
    """
    key = f"{PREFIX}:min:{order_id}"
    if client.set(key, b"\x00", nx=True, px=LEASE_MS):
        result = pay_result(order_id)
        client.set(key, json.dumps(result).encode(), px=TTL_MS)
        return result
    return minimum_replay(client, order_id)


def make_minimum(url: str) -> Scenario:
    client = redis.Redis.from_url(url)

    def op() -> None:
        key = fresh_key("min")
        expect(minimum_pay(client, key, AMOUNT), key, "minimum")

    return Scenario("minimum", op, client.close)


def minimum_replay(client: redis.Redis, order_id: str) -> dict[str, str]:
    """The least a replay costs: one GET of a key known to be completed, decoded."""
    stored = client.get(f"{PREFIX}:min:{order_id}")
    if stored is None or stored == b"\x00":
        raise RuntimeError(f"{order_id} is in progress, or gone")
    value: dict[str, str] = json.loads(stored)
    return value


def make_minimum_replay(url: str) -> Scenario:
    client = redis.Redis.from_url(url)
    key = fresh_key("min-replay")
    minimum_pay(client, key, AMOUNT)
    return Scenario(
        "minimum_replay",
        lambda: expect(minimum_replay(client, key), key, "minimum replay"),
        client.close,
    )


def make_minimum_async_replay(url: str) -> Scenario:
    """`minimum_replay` on redis.asyncio, each GET run to its end on one loop (as
    idempo_async_replay's calls are)."""
    import redis.asyncio

    loop = asyncio.new_event_loop()
    client = redis.asyncio.Redis.from_url(url)
    key = fresh_key("min-async-replay")
    with redis.Redis.from_url(url) as setup:
        minimum_pay(setup, key, AMOUNT)

    async def replay() -> dict[str, str]:
        stored = await client.get(f"{PREFIX}:min:{key}")
        if stored is None or stored == b"\x00":
            raise RuntimeError(f"{key} is in progress, or gone")
        value: dict[str, str] = json.loads(stored)
        return value

    def close() -> None:
        loop.run_until_complete(client.aclose())
        loop.close()

    return Scenario(
        "minimum_async_replay",
        lambda: expect(loop.run_until_complete(replay()), key, "minimum async replay"),
        close,
    )


# --------------------------------------------------------------------------- libraries


PayFactory = Callable[[str], tuple[Callable[[str, int], Any], Callable[[], None]]]


def library_scenarios(name: str, make_pay: PayFactory) -> tuple[ScenarioFactory, ScenarioFactory]:
    """Fresh-key and replay scenarios for a library whose ``make_pay(url)`` gives its guarded
    ``pay(order_id, amount)`` and a ``close``."""

    def fresh(url: str) -> Scenario:
        pay, close = make_pay(url)

        def op() -> None:
            key = fresh_key(name)
            expect(pay(key, AMOUNT), key, name)

        return Scenario(name, op, close)

    def replay(url: str) -> Scenario:
        pay, close = make_pay(url)
        key = fresh_key(f"{name}-replay")
        pay(key, AMOUNT)
        return Scenario(f"{name}_replay", lambda: expect(pay(key, AMOUNT), key, name), close)

    return fresh, replay


# --------------------------------------------------------------------------- idempo


def make_idempo_pay(url: str, cache: int) -> tuple[Callable[..., Any], Callable[[], None]]:
    """idempo's function API, as docs/function-api.md shows it."""
    from idempo import Idempotency
    from idempo.stores.cache import CachedStore
    from idempo.stores.redis import RedisStore

    store: Any = RedisStore(url, prefix=f"{PREFIX}:idempo")
    if cache:
        store = CachedStore(store, max_entries=cache)
    idem = Idempotency(store)

    @idem.idempotent(key="order_id")
    def pay(order_id: str, amount: int) -> dict[str, str]:
        return pay_result(order_id)

    return pay, store.close


make_idempo, make_idempo_replay = library_scenarios("idempo", lambda url: make_idempo_pay(url, 0))


def make_idempo_async_pay(url: str) -> tuple[Callable[..., Any], Callable[[], None]]:
    """The same on AsyncIdempotency(AsyncRedisStore), each call run to its end on one loop."""
    from idempo import AsyncIdempotency
    from idempo.stores.redis import AsyncRedisStore

    loop = asyncio.new_event_loop()
    store = AsyncRedisStore(url, prefix=f"{PREFIX}:idempo-async")
    idem = AsyncIdempotency(store)

    @idem.idempotent(key="order_id")
    async def pay(order_id: str, amount: int) -> dict[str, str]:
        return pay_result(order_id)

    def close() -> None:
        loop.run_until_complete(store.aclose())
        loop.close()

    return lambda order_id, amount: loop.run_until_complete(pay(order_id, amount)), close


make_idempo_async, make_idempo_async_replay = library_scenarios(
    "idempo_async", make_idempo_async_pay
)
make_idempo_cached, make_idempo_cached_replay = library_scenarios(
    "idempo_cached", lambda url: make_idempo_pay(url, 10_000)
)


# --------------------------------------------------------------------------- Powertools


class FakeLambdaContext:
    """What Powertools reads from a Lambda context: the time left, for the in-progress expiry."""

    function_name = "idempo-bench"
    memory_limit_in_mb = 128
    invoked_function_arn = "arn:aws:lambda:eu-west-1:123456789012:function:idempo-bench"
    aws_request_id = "bench"

    def get_remaining_time_in_millis(self) -> int:
        return LEASE_MS


def make_powertools_pay(url: str) -> tuple[Callable[..., Any], Callable[[], None]]:
    """Powertools' ``idempotent_function`` on its Redis persistence layer, as its docs show:

    client = Redis(host=..., port=..., decode_responses=True)
    persistence_layer = CachePersistenceLayer(client=client)
    config = IdempotencyConfig(event_key_jmespath="order_id")

    @idempotent_function(data_keyword_argument="order", config=config,
                         persistence_store=persistence_layer)
    def process_order(order): ...

    def lambda_handler(event, context):
        config.register_lambda_context(context)
    """
    os.environ.setdefault("AWS_LAMBDA_FUNCTION_NAME", "idempo-bench")
    from aws_lambda_powertools.utilities.idempotency import (
        IdempotencyConfig,
        idempotent_function,
    )
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
        CachePersistenceLayer,
    )

    client = redis.Redis.from_url(url, decode_responses=True)
    with warnings.catch_warnings():
        # The class behind the documented alias carries a v4 deprecation notice.
        warnings.simplefilter("ignore", DeprecationWarning)
        persistence_layer = CachePersistenceLayer(client=client)
    config = IdempotencyConfig(event_key_jmespath="order_id")

    @idempotent_function(
        data_keyword_argument="order",
        config=config,
        persistence_store=persistence_layer,
        key_prefix=f"{PREFIX}:powertools",
    )
    def process_order(order: dict[str, Any]) -> dict[str, str]:
        return pay_result(order["order_id"])

    config.register_lambda_context(FakeLambdaContext())  # type: ignore[arg-type]

    def pay(order_id: str, amount: int) -> Any:
        return process_order(order={"order_id": order_id, "amount": amount})

    return pay, client.close


make_powertools, make_powertools_replay = library_scenarios("powertools", make_powertools_pay)


# --------------------------------------------------------------------------- idemkit


def make_idemkit_pay(url: str) -> tuple[Callable[..., Any], Callable[[], None]]:
    """idemkit's function decorator on its Redis backend, as its README shows:

    @idempotent(backend=RedisBackend.from_url("redis://..."),
                config=MethodConfig(key_fields=["order_id", "amount"]))
    async def refund(*, order_id, amount): ...
    "Sync code uses idempotent_sync"
    """
    from idemkit import MethodConfig, RedisBackend, idempotent_sync
    from idemkit.core.sync_bridge import run_sync

    backend = RedisBackend.from_url(url, namespace=f"{PREFIX}:idemkit")
    with warnings.catch_warnings():
        # The bench is single-tenant on purpose; idemkit warns once when no scope is set.
        warnings.filterwarnings("ignore", message=".*has no scope.*")

        @idempotent_sync(backend=backend, config=MethodConfig(key_fields=["order_id", "amount"]))
        def pay(*, order_id: str, amount: int) -> dict[str, str]:
            return pay_result(order_id)

    def close() -> None:
        # The client lives on idemkit's background loop and must be closed there.
        run_sync(backend.aclose())

    return lambda order_id, amount: pay(order_id=order_id, amount=amount), close


make_idemkit, make_idemkit_replay = library_scenarios("idemkit", make_idemkit_pay)


# --------------------------------------------------------------------------- the table

# Order is the table's order; "kind" says what one call is when reading round trips.
FACTORIES: dict[str, tuple[str, ScenarioFactory]] = {
    "minimum": ("fresh", make_minimum),
    "minimum_replay": ("replay", make_minimum_replay),
    "idempo": ("fresh", make_idempo),
    "idempo_replay": ("replay", make_idempo_replay),
    "minimum_async_replay": ("replay", make_minimum_async_replay),
    "idempo_async": ("fresh", make_idempo_async),
    "idempo_async_replay": ("replay", make_idempo_async_replay),
    "idempo_cached": ("fresh", make_idempo_cached),
    "idempo_cached_replay": ("replay", make_idempo_cached_replay),
    "powertools": ("fresh", make_powertools),
    "powertools_replay": ("replay", make_powertools_replay),
    "idemkit": ("fresh", make_idemkit),
    "idemkit_replay": ("replay", make_idemkit_replay),
}

# (numerator, denominator, the goal for the ratio)
RATIOS: list[tuple[str, str, float | None]] = [
    # The goals are issue 15's.
    ("idempo", "minimum", 0.8),
    ("idempo_replay", "minimum_replay", 0.8),
    ("idempo", "powertools", 1.3),
    ("idempo_replay", "powertools_replay", 3.0),
    ("idempo", "idemkit", 1.0),
    ("idempo_replay", "idemkit_replay", 1.0),
    ("idempo_async_replay", "minimum_async_replay", None),
    ("idempo_async", "idempo", None),
    ("idempo_cached_replay", "idempo_replay", 10.0),
    ("idempo_cached", "idempo", None),
    ("idempo_cached_replay", "minimum_replay", None),
]


# --------------------------------------------------------------------------- measuring


def count_all_round_trips(results: dict[str, Result], url: str, calls: int, warmup: int) -> None:
    """Round trips per call of every scenario, through one proxy in front of Redis."""
    parts = urlsplit(url)
    with RoundTripProxy(parts.hostname or "127.0.0.1", parts.port or 6379) as proxy:
        for name, result in results.items():
            factory = FACTORIES[name][1]
            result.round_trips = count_round_trips(factory, proxy, url, calls, warmup)


def client_cpu_us(scenario: Scenario, calls: int) -> float:
    """This process's CPU time per call (every thread: idemkit's event loop counts too)."""
    start = time.process_time()
    for _ in range(calls):
        scenario.op()
    return (time.process_time() - start) / calls * 1e6


def cleanup(url: str, prefix: str = PREFIX) -> int:
    """Delete every key this run made (bench/redis_growth.py's too, under its prefix)."""
    deleted = 0
    with redis.Redis.from_url(url) as client:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for start in range(0, len(keys), 500):
            deleted += int(client.delete(*keys[start : start + 500]))
    return deleted


# --------------------------------------------------------------------------- server CPU


@contextmanager
def sent_commands() -> Iterator[Counter[str]]:
    """The commands this process sends while the block runs, by name (every redis-py
    connection class, sync and async, single and pipelined): what Redis ran at top level."""
    import redis.asyncio.connection

    counts: Counter[str] = Counter()
    patched: list[tuple[Any, str, Any]] = []

    def name(args: Any) -> str:
        first = args[0]
        return (first.decode() if isinstance(first, bytes) else str(first)).split()[0].lower()

    # A synchronous connection sends one command with send_command, an asynchronous one
    # packs it with pack_command; both pack a pipeline with pack_commands.
    singles = (
        (redis.connection.AbstractConnection, "send_command"),
        (redis.asyncio.connection.AbstractConnection, "pack_command"),
    )
    for cls, single in singles:
        one, many = getattr(cls, single), cls.pack_commands

        def send_one(self: Any, *args: Any, _one: Any = one, **kwargs: Any) -> Any:
            counts[name(args)] += 1
            return _one(self, *args, **kwargs)

        def pack_commands(self: Any, commands: Any, _many: Any = many) -> Any:
            commands = list(commands)
            for command in commands:
                counts[name(command)] += 1
            return _many(self, commands)

        patched += [(cls, single, one), (cls, "pack_commands", many)]
        setattr(cls, single, send_one)
        cls.pack_commands = pack_commands  # type: ignore[method-assign]
    # The store's lane packs its hot commands itself and hands the bytes to the connection
    # (idempo.stores.redis._lane): counted from the packed bytes' first argument.
    from idempo.stores.redis import _lane

    def lane_name(packed: bytes) -> str:
        return packed.split(b"\r\n", 3)[2].decode().lower()

    def lane_send(conn: Any, packed: bytes, _send: Any = _lane._send) -> Any:
        counts[lane_name(packed)] += 1
        return _send(conn, packed)

    async def lane_asend(conn: Any, packed: bytes, _asend: Any = _lane._asend) -> Any:
        counts[lane_name(packed)] += 1
        return await _asend(conn, packed)

    patched += [(_lane, "_send", _lane._send), (_lane, "_asend", _lane._asend)]
    _lane._send, _lane._asend = lane_send, lane_asend  # type: ignore[assignment]
    try:
        yield counts
    finally:
        for cls, attribute, original in patched:
            setattr(cls, attribute, original)


@dataclass
class ServerCost:
    """What Redis spent on one scenario's calls, per call."""

    calls: int
    # command -> (sent by the client per call, run by scripts per call, usec_per_call)
    commands: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    main_thread_us: float = 0.0

    @property
    def command_us(self) -> float:
        """Redis's command time per call: what the client sent (a script with what it ran)."""
        return sum(sent * usec for sent, _, usec in self.commands.values())


def _server_cpu(client: redis.Redis) -> float:
    info: Any = client.info("cpu")
    return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])


def server_cost(factory: ScenarioFactory, url: str, calls: int, warmup: int) -> ServerCost:
    """One scenario's Redis time per call, from INFO commandstats and INFO cpu deltas."""
    scenario = factory(url)
    admin = redis.Redis.from_url(url)
    try:
        warm_up(scenario, warmup)
        admin.config_resetstat()
        cpu = _server_cpu(admin)
        with sent_commands() as sent:
            for _ in range(calls):
                scenario.op()
        cpu = _server_cpu(admin) - cpu
        stats: Any = admin.info("commandstats")
    finally:
        scenario.close()
        admin.close()
    cost = ServerCost(calls, main_thread_us=cpu / calls * 1e6)
    for field_name, values in stats.items():
        command = field_name.removeprefix("cmdstat_")
        if command.split("|")[0] in ("config", "info"):
            continue
        total = int(values["calls"])
        top = min(sent.get(command, 0), total)
        cost.commands[command] = (
            top / calls,
            (total - top) / calls,
            float(values["usec_per_call"]),
        )
    return cost


def measure_server(
    url: str, only: tuple[str, ...], calls: int, warmup: int
) -> dict[str, ServerCost]:
    costs = {}
    for name in only:
        try:
            costs[name] = server_cost(FACTORIES[name][1], url, calls, warmup)
        except Exception as exc:
            print(f"{name}: no server cost ({type(exc).__name__}: {exc})")
    return costs


def print_server(costs: dict[str, ServerCost]) -> None:
    print("\nRedis time per call (INFO commandstats; sent/script = commands per call):")
    print(f"{'scenario':<22}{'command µs':>11}{'main thread':>12}  commands (sent+script x usec)")
    for name, cost in costs.items():
        parts = [
            f"{command} {sent:g}+{inner:g}x{usec:.1f}"
            for command, (sent, inner, usec) in sorted(cost.commands.items())
        ]
        print(f"{name:<22}{cost.command_us:>11.1f}{cost.main_thread_us:>12.1f}  {', '.join(parts)}")


# --------------------------------------------------------------------------- reporting


def versions() -> str:
    from redis.utils import HIREDIS_AVAILABLE

    parser = "hiredis" if HIREDIS_AVAILABLE else "pure-Python parser"
    found = [f"python {sys.version.split()[0]}", f"redis-py {redis.__version__} ({parser})"]
    for dist in ("aws-lambda-powertools", "idemkit"):
        try:
            from importlib.metadata import version

            found.append(f"{dist} {version(dist)}")
        except Exception:
            found.append(f"{dist} missing")
    return ", ".join(found)


def print_header(url: str, rounds: int, slice_s: float, count_calls: int) -> None:
    with redis.Redis.from_url(url) as client:
        info: Any = client.info("server")
    print(f"Redis {info.get('redis_version', '?')} at {url}; {versions()}")
    print(
        f"{rounds} interleaved rounds x {slice_s:.2f} s per scenario; "
        f"round trips averaged over {count_calls} calls through a counting proxy; "
        f"client CPU (this process, all threads) over {count_calls * 5} calls\n"
    )


def print_table(results: dict[str, Result], cpu: dict[str, float]) -> None:
    print(
        f"{'scenario':<22}{'kind':<8}{'calls/s':>9}{'min':>9}{'max':>9}{'RT/call':>9}{'CPU us':>8}"
    )
    for name, result in results.items():
        rt = f"{result.round_trips:.2f}" if result.round_trips is not None else "-"
        print(
            f"{name:<22}{result.kind:<8}{result.median:>9.0f}{min(result.ops_per_s):>9.0f}"
            f"{max(result.ops_per_s):>9.0f}{rt:>9}{cpu.get(name, float('nan')):>8.0f}"
        )


def print_ratios(results: dict[str, Result]) -> None:
    print("\nratios of median calls/s (same run):")
    for top, bottom, goal in RATIOS:
        label = f"{top} / {bottom}"
        if top not in results or bottom not in results:
            print(f"  {label:<44}{'n/a':>7}")
            continue
        ratio = results[top].median / results[bottom].median
        report("redis", label, ratio, goal, round_trips=results[top].round_trips)
        verdict = (
            "" if goal is None else f"  goal >= {goal:g}: {'met' if ratio >= goal else 'MISSED'}"
        )
        print(f"  {label:<44}{ratio:>7.2f}{verdict}")


# --------------------------------------------------------------------------- main


@dataclass
class Settings:
    url: str
    seconds: float
    rounds: int
    count_calls: int
    warmup: int
    instructions: bool = False
    scenario: str | None = None
    only: tuple[str, ...] = tuple(FACTORIES)
    server_only: bool = False
    server_calls: int = 3000
    no_server: bool = False


def parse_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--url", default=DEFAULT_URL, help="Redis URL (default: %(default)s)")
    parser.add_argument(
        "--seconds", type=float, help="total timed seconds, split over all rounds and scenarios"
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds per scenario")
    parser.add_argument("--quick", action="store_true", help="short smoke run (~15 s)")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="instead: client CPU instructions per call of each scenario, under valgrind"
        " (slow: about a minute per scenario, but the same on a busy machine as on a quiet one)",
    )
    parser.add_argument(
        "--only",
        help="comma-separated scenarios to run (default: all)",
        default=",".join(FACTORIES),
    )
    parser.add_argument(
        "--server-only",
        action="store_true",
        help="only the Redis time per call (INFO commandstats), no calls/s",
    )
    parser.add_argument(
        "--no-server",
        action="store_true",
        help="skip the Redis time per call (it resets INFO commandstats: not on a shared server)",
    )
    parser.add_argument("--scenario", choices=FACTORIES, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    only = tuple(name for name in args.only.split(",") if name)
    unknown = set(only) - set(FACTORIES)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    if args.quick:
        quick = Settings(
            args.url,
            args.seconds or 10.0,
            args.rounds or 2,
            50,
            20,
            only=only,
            server_only=args.server_only,
            server_calls=300,
        )
        quick.no_server = args.no_server
        return quick
    settings = Settings(
        args.url,
        args.seconds or 100.0,
        args.rounds or 5,
        args.calls or 200,
        100,
        args.instructions,
        args.scenario,
        only,
        args.server_only,
    )
    settings.no_server = args.no_server
    return settings


# --------------------------------------------------------------------------- instructions

# Calls in the two runs whose difference is measured: start-up and warm-up cancel out.
INSTRUCTION_CALLS = (200, 1200)


def run_one(settings: Settings) -> None:
    """The process valgrind watches: build one scenario, warm it up, make the calls."""
    assert settings.scenario is not None
    # The parent deletes the keys: a cleanup here would SCAN the whole keyspace, whose cost
    # grows with whatever else the server holds, inside the count.
    counted_calls(FACTORIES[settings.scenario][1](settings.url), settings.count_calls)


def instructions(name: str, url: str, calls: int) -> int:
    """Instructions the whole client process (every thread) executed, under callgrind."""
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    command += [sys.executable, __file__, "--url", url, "--scenario", name, "--calls", str(calls)]
    env = {**os.environ, "IDEMPO_BENCH_RUN_ID": RUN_ID}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count from valgrind for {name}: {done.stderr[-500:]}")
    return int(found.group(1))


def print_instructions(url: str, only: tuple[str, ...]) -> None:
    low, high = INSTRUCTION_CALLS
    print(f"client instructions per call (callgrind; runs of {low} and {high} calls, differenced)")
    counts: dict[str, float] = {}
    for name in only:
        counts[name] = (instructions(name, url, high) - instructions(name, url, low)) / (high - low)
        print(f"  {name:<22}{counts[name] / 1000:>9.0f} k")
    for top, bottom, _ in RATIOS:
        if top in counts and bottom in counts:
            print(f"  {top} / {bottom}: {counts[top] / counts[bottom]:.2f}x the instructions")
            report_instructions("redis", top, bottom, counts)


def build_available(url: str, only: tuple[str, ...], notes: list[str]) -> list[Scenario]:
    """Build every scenario asked for that can run; one whose library is missing becomes a
    note."""
    scenarios = []
    for name in only:
        factory = FACTORIES[name][1]
        try:
            scenarios.append(factory(url))
        except Exception as exc:
            notes.append(f"{name}: not available ({type(exc).__name__}: {exc})")
    return scenarios


def run(settings: Settings) -> None:
    if settings.server_only:
        print_header(settings.url, 0, 0.0, 0)
        print_server(
            measure_server(settings.url, settings.only, settings.server_calls, settings.warmup)
        )
        return
    notes: list[str] = []
    scenarios = build_available(settings.url, settings.only, notes)
    results = {s.name: Result(FACTORIES[s.name][0]) for s in scenarios}
    slice_s = settings.seconds / (settings.rounds * len(scenarios))
    print_header(settings.url, settings.rounds, slice_s, settings.count_calls)
    try:
        for scenario in scenarios:
            warm_up(scenario, settings.warmup)
        measure_throughput(scenarios, results, settings.rounds, slice_s)
        cpu = {s.name: client_cpu_us(s, settings.count_calls * 5) for s in scenarios}
    finally:
        for scenario in scenarios:
            scenario.close()
    count_all_round_trips(results, settings.url, settings.count_calls, settings.warmup)
    costs = {}
    if not settings.no_server:
        costs = measure_server(settings.url, tuple(results), settings.server_calls, settings.warmup)

    print_table(results, cpu)
    print_ratios(results)
    print_server(costs)
    for note in notes:
        print(note)


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    if settings.scenario is not None:
        run_one(settings)
        return
    try:
        if settings.instructions:
            print_instructions(settings.url, settings.only)
        else:
            run(settings)
    finally:
        print(f"\ncleanup: deleted {cleanup(settings.url)} keys under {PREFIX}")


if __name__ == "__main__":
    main()
