"""Microseconds per request of idempo's ASGI middleware, in process: no server, no sockets.

The same Starlette app as bench/asgi_middleware.py (`POST /items`, a small JSON 201) is
called directly as an ASGI app, one request after another in a tight event loop (uvloop, as
under the real bench, unless told otherwise), with the
scope, ``receive`` and ``send`` a server would give it (the headers wrk sends). What is left
is the Python work per request: Starlette's own, plus idempo's where the middleware is on.

Scenarios:

    bare              no middleware
    memory, sqlite    IdempotencyMiddleware on open_async_store("memory://" | "sqlite:///...")
    aih               the peer asgi-idempotency-header's middleware, its MemoryBackend (it
                      keeps the response by key alone: no body read, no fingerprint)
    *_replay          the same, one primed key for every request

Scenarios run in interleaved rounds and the table shows each one's best round (the least
disturbed by other processes on a shared machine) and its median.

    python bench/asgi_overhead.py [--requests N] [--rounds R] [--only memory,bare]
    python bench/asgi_overhead.py --profile memory          # cProfile of one scenario
    python bench/asgi_overhead.py --opcodes memory          # bytecodes per request, by function
    python bench/asgi_overhead.py --instructions            # callgrind: instructions/request

``--instructions`` runs each scenario under ``valgrind --tool=callgrind`` twice, with two
request counts, and reports the difference per request: deterministic however loaded the
machine is, and free of start-up costs. ``--opcodes`` counts the Python bytecodes each
function runs per request (sys.settrace): deterministic too, and it names the functions.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib.util
import io
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _measure import callgrind_count
from _report import report as report_row
from asgi_middleware import BODY, build_app, migrate  # the real bench's app, not a copy

KINDS = {"bare": "bare", "memory": "idempo_memory", "sqlite": "idempo_sqlite", "aih": "aih"}
SCENARIOS = ["bare", "memory", "memory_replay", "sqlite", "sqlite_replay", "aih", "aih_replay"]

Message = dict[str, Any]
App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def scope_for(key: bytes) -> dict[str, Any]:
    """What uvicorn (httptools) hands the app for wrk's request."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 40000),
        "scheme": "http",
        "method": "POST",
        "root_path": "",
        "path": "/items",
        "raw_path": b"/items",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-length", str(len(BODY)).encode()),
            (b"content-type", b"application/json"),
            (b"idempotency-key", key),
        ],
        "state": {},
    }


class Client:
    """Calls one app as a server would, and checks every answer."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.status = 0
        self.replayed = False

    async def request(self, key: bytes) -> None:
        sent_body = False

        async def receive() -> Message:
            nonlocal sent_body
            if sent_body:
                return {"type": "http.disconnect"}
            sent_body = True
            return {"type": "http.request", "body": BODY, "more_body": False}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
                self.replayed = (b"idempotent-replayed", b"true") in message["headers"]

        await self.app(scope_for(key), receive, send)

    async def check(self, key: bytes, *, replayed: bool) -> None:
        await self.request(key)
        if self.status != 201 or self.replayed != replayed:
            raise RuntimeError(f"status {self.status}, replayed {self.replayed}: broken bench")


class Scenario:
    def __init__(self, name: str, app: App) -> None:
        self.name = name
        self.client = Client(app)
        self.replay = name.endswith("_replay")
        self.fresh = 0
        self.rounds: list[float] = []

    def keys(self, n: int) -> list[bytes]:
        if self.replay:
            return [f"{self.name}-key".encode()] * n
        first, self.fresh = self.fresh, self.fresh + n
        return [f"{self.name}-{i}".encode() for i in range(first, first + n)]

    async def prime(self) -> None:
        if self.replay:
            await self.client.check(self.keys(1)[0], replayed=False)
            await self.client.check(self.keys(1)[0], replayed=True)
        elif self.name != "bare":
            await self.client.check(self.keys(1)[0], replayed=False)

    async def run(self, n: int) -> float:
        """Seconds per request over ``n`` requests."""
        keys = self.keys(n)
        request = self.client.request
        start = time.perf_counter()
        for i, key in enumerate(keys, 1):
            await request(key)
            if i % 100 == 0:
                # Let the loop turn now and then, as a server's does between requests: it
                # closes the handles of cancelled timers, which would otherwise pile up.
                await asyncio.sleep(0)
        elapsed = time.perf_counter() - start
        if self.client.status != 201:
            raise RuntimeError(f"{self.name}: last answer {self.client.status}")
        return elapsed / n


async def build(names: list[str], tmp: str) -> list[Scenario]:
    sqlite_url = f"sqlite:///{tmp}/idempo.db"
    if any(name.startswith("sqlite") for name in names):
        await migrate(sqlite_url)
    apps: dict[str, App] = {}
    scenarios = []
    for name in names:
        kind = KINDS[name.removesuffix("_replay")]
        if kind not in apps:
            apps[kind] = build_app(kind, sqlite_url)
        scenario = Scenario(name, apps[kind])
        await scenario.prime()
        scenarios.append(scenario)
    return scenarios


async def timed(
    names: list[str], requests: int, rounds: int, tmp: str, *, warmup: bool = True
) -> list[Scenario]:
    scenarios = await build(names, tmp)
    for scenario in scenarios if warmup else ():  # excluded
        await scenario.run(max(1, requests // 5))
    for r in range(rounds):
        shift = r % len(scenarios)
        for scenario in scenarios[shift:] + scenarios[:shift]:
            scenario.rounds.append(await scenario.run(requests))
    return scenarios


def report(scenarios: list[Scenario]) -> None:
    by_name = {s.name: s for s in scenarios}
    bare = by_name.get("bare")
    print(f"{'scenario':<16}{'best µs':>9}{'median µs':>11}{'overhead µs':>13}{'bare/this':>11}")
    for s in scenarios:
        best, median = min(s.rounds) * 1e6, statistics.median(s.rounds) * 1e6
        line = f"{s.name:<16}{best:>9.1f}{median:>11.1f}"
        if bare is not None and s is not bare:
            base = min(bare.rounds) * 1e6
            line += f"{best - base:>13.1f}{base / best:>11.2f}"
        print(line)


def profile(name: str, requests: int, tmp: str, top: int) -> None:
    async def go() -> None:
        (scenario,) = await build([name], tmp)
        await scenario.run(requests // 5)
        profiler = cProfile.Profile()
        profiler.enable()
        await scenario.run(requests)
        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        print(out.getvalue())

    run_loop(go(), "asyncio")


def opcodes(name: str, requests: int, tmp: str, top: int) -> None:
    """Bytecodes run per request, in all and by function (the function's own, not its callees')."""
    counts: Counter[str] = Counter()

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            code = frame.f_code
            counts[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        return trace

    async def go() -> None:
        (scenario,) = await build([name], tmp)
        await scenario.run(max(1, requests // 5))
        keys = scenario.keys(requests)
        sys.settrace(trace)
        try:
            for key in keys:
                await scenario.client.request(key)
        finally:
            sys.settrace(None)

    run_loop(go(), "asyncio")
    print(f"{sum(counts.values()) / requests:.0f} bytecodes per request; by function:")
    for where, count in counts.most_common(top):
        print(f"{count / requests:>8.1f}  {where}")


def instructions(names: list[str], small: int, large: int, loop: str) -> None:
    """Instructions per request under callgrind: (Ir at ``large`` - Ir at ``small``) / Δn."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("valgrind not found: apt-get install valgrind")
    print(f"{'scenario':<16}{'instr/req':>11}{'overhead':>11}")
    base: float | None = None
    measured: dict[str, float] = {}
    for name in names:
        args = ["--only", name, "--rounds", "1", "--no-warmup", "--loop", loop]
        counts = [
            callgrind_count(valgrind, sys.argv[0], [*args, "--requests", str(n)])
            for n in (small, large)
        ]
        per = measured[name] = (counts[1] - counts[0]) / (large - small)
        if name == "bare":
            base = per
        extra = f"{per - base:>11.0f}" if base is not None and name != "bare" else ""
        print(f"{name:<16}{per:>11.0f}{extra}", flush=True)
        if base is not None and name not in ("bare", *_PEERS):
            report_instructions(name, per, base)
    for ours, peer in _AGAINST_PEER:
        if ours in measured and peer in measured:
            ratio = measured[ours] / measured[peer]
            print(f"{ours} / {peer}: {ratio:.2f}x the instructions")
            report_row(
                "asgi",
                f"{ours}: instructions / asgi-idempotency-header's ({peer})",
                ratio,
                None,
                lower_is_better=True,
            )


# The peer's scenarios (asgi-idempotency-header, which reads no body and keeps no
# fingerprint) are compared with idempo's, not held to idempo's goals.
_PEERS = ("aih", "aih_replay")
_AGAINST_PEER = (("memory", "aih"), ("memory_replay", "aih_replay"))

# Issue 15's goals, in instructions against the bare endpoint's: a replay costs at most the
# endpoint itself; a fresh request's overhead (over the endpoint) at most this share of it.
_REPLAY_GOAL = 1.0
_OVERHEAD_GOALS = {"memory": 0.5, "sqlite": 2.0}


def report_instructions(name: str, per: float, base: float) -> None:
    if name.endswith("_replay"):
        report_row(
            "asgi",
            f"{name}: instructions / bare endpoint's",
            per / base,
            _REPLAY_GOAL,
            lower_is_better=True,
        )
    else:
        report_row(
            "asgi",
            f"{name}: overhead instructions / bare endpoint's",
            (per - base) / base,
            _OVERHEAD_GOALS.get(name),
            lower_is_better=True,
        )


def run_loop(coro: Any, loop: str) -> Any:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--requests", type=int, default=5000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", help="comma-separated scenarios: " + ", ".join(SCENARIOS))
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--profile", metavar="SCENARIO", help="cProfile one scenario")
    parser.add_argument("--opcodes", metavar="SCENARIO", help="count one scenario's bytecodes")
    parser.add_argument("--top", type=int, default=40, help="rows of a profile or count")
    parser.add_argument("--instructions", action="store_true", help="count with callgrind")
    parser.add_argument(
        "--counts",
        default="300,1000",
        help="with --instructions: the two request counts whose difference is measured",
    )
    parser.add_argument("--no-warmup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.only.split(",") if args.only else SCENARIOS
    if not args.only and importlib.util.find_spec("idempotency_header_middleware") is None:
        # The peer comes with the bench dependency group only.
        names = [name for name in names if name not in _PEERS]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {sorted(unknown)}")
    with tempfile.TemporaryDirectory(prefix="idempo-overhead-") as tmp:
        if args.profile:
            profile(args.profile, args.requests, tmp, args.top)
        elif args.opcodes:
            opcodes(args.opcodes, min(args.requests, 500), tmp, args.top)
        elif args.instructions:
            small, large = (int(n) for n in args.counts.split(","))
            instructions(names, small, large, args.loop)
        else:
            scenarios = run_loop(
                timed(names, args.requests, args.rounds, tmp, warmup=not args.no_warmup),
                args.loop,
            )
            report(scenarios)


if __name__ == "__main__":
    main()
