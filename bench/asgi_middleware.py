"""Requests/s of a trivial endpoint behind idempotency middlewares, measured in one run.

Every server is the same Starlette app (`POST /items`: reads the body, returns a small JSON
201) under uvicorn, one worker, one process each, on its own free 127.0.0.1 port, all with
the same settings. The load generator is `wrk` in another process (keep-alive connections,
a Lua script that gives every request its own Idempotency-Key, or the same one for replays).

Scenarios:

    bare                  no middleware (the baseline for fresh keys and replays)
    idempo_memory         idempo.asgi.IdempotencyMiddleware, open_async_store("memory://")
    idempo_sqlite         the same, open_async_store("sqlite:///<tmp>/idempo.db"), migrated
    idemkit               idemkit.IdempotencyMiddleware, InMemoryBackend (see PEERS below)
    aih                   asgi-idempotency-header's IdempotencyHeaderMiddleware, MemoryBackend
    *_replay              the same server, the same key on every request (a primed replay)

Scenarios run in interleaved rounds with a rotating order after an excluded warm-up, and the
table reports the median requests/s, so one noisy moment does not decide a ratio. Before
timing, each server is checked: a fresh key runs the handler once and its duplicate is a
replay (no second run, same status and body). During timing the handler's run counter is
read around every slice, so a "replay" that runs the handler, or a fresh key that does not,
shows in the `runs/req` column; non-2xx answers and socket errors are counted too.

Usage: python bench/asgi_middleware.py [--seconds N] [--quick] [--rounds R] [--connections C]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import json
import os
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _report import report as report_row  # bench/ is the script's own directory

RUN_ID = secrets.token_hex(4)
BODY = b'{"name":"widget","qty":1}'
# idemkit's InMemoryBackend refuses new keys past max_size (default 10_000) with a 503; a
# run sends far more fresh keys than that, so the bench raises the cap (see PEERS).
IDEMKIT_MAX_SIZE = 50_000_000

# What each peer needs, exactly as set up below (printed with the results).
PEERS = """\
peers, each used as its README shows, added with Starlette's middleware=[Middleware(...)]:
  idemkit: Middleware(idemkit.IdempotencyMiddleware,
                      backend=idemkit.InMemoryBackend(max_size=50_000_000))
           (README: app.add_middleware(IdempotencyMiddleware, backend=InMemoryBackend());
           max_size raised from its default 10_000, past which new keys get 503)
  aih:     Middleware(idempotency_header_middleware.IdempotencyHeaderMiddleware,
                      backend=idempotency_header_middleware.backends.MemoryBackend())
           (README's second form; its first, app.add_middleware(IdempotencyHeaderMiddleware(
           backend=backend)), raises TypeError: the dataclass needs `app` first;
           installed with redis importable (idempo[redis]): the package imports redis even
           for MemoryBackend, so the README's plain `pip install` cannot start)"""

WRK_SCRIPT = """\
-- One key per request (fresh) or one key for all (replay); args: prefix mode.
local prefix, mode, n = "k", "fresh", 0
local headers = {["Content-Type"] = "application/json"}
local body = '@BODY@'
local next_thread = 0

function setup(thread)
  thread:set("tid", next_thread)
  next_thread = next_thread + 1
end

function init(args)
  prefix, mode = args[1], args[2]
  if mode == "fresh" then prefix = prefix .. "-t" .. tostring(tid) end
end

function request()
  if mode == "fresh" then
    n = n + 1
    headers["Idempotency-Key"] = prefix .. "-" .. n
  else
    headers["Idempotency-Key"] = prefix
  end
  return wrk.format("POST", "/items", headers, body)
end
""".replace("@BODY@", BODY.decode())

REPLAY_HEADERS = ("idempotent-replayed", "idempotency-replayed")


# --------------------------------------------------------------------------- the server


def build_app(kind: str, sqlite_url: str | None) -> Any:
    """The Starlette app for one server; `kind` picks the middleware (or none)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    runs = itertools.count(1)
    state = {"runs": 0}

    async def create_item(request: Request) -> JSONResponse:
        payload = json.loads(await request.body())
        state["runs"] = next(runs)
        return JSONResponse({"id": state["runs"], "name": payload["name"]}, status_code=201)

    async def stats(request: Request) -> JSONResponse:
        return JSONResponse({"runs": state["runs"]})

    middleware: list[Middleware] = []
    if kind in {"idempo_memory", "idempo_sqlite"}:
        from idempo import open_async_store
        from idempo.asgi import IdempotencyMiddleware

        url = "memory://" if kind == "idempo_memory" else sqlite_url
        middleware.append(Middleware(IdempotencyMiddleware, store=open_async_store(url)))
    elif kind == "idemkit":
        import idemkit

        backend = idemkit.InMemoryBackend(max_size=IDEMKIT_MAX_SIZE)
        middleware.append(Middleware(idemkit.IdempotencyMiddleware, backend=backend))
    elif kind == "aih":
        from idempotency_header_middleware import IdempotencyHeaderMiddleware
        from idempotency_header_middleware.backends import MemoryBackend

        middleware.append(Middleware(IdempotencyHeaderMiddleware, backend=MemoryBackend()))
    elif kind != "bare":
        raise ValueError(f"unknown server kind {kind!r}")

    routes = [
        Route("/items", create_item, methods=["POST"]),
        Route("/stats", stats, methods=["GET"]),
    ]
    return Starlette(routes=routes, middleware=middleware)


def serve(kind: str, port: int, sqlite_url: str | None, loop: str, http_impl: str) -> None:
    import logging
    import warnings

    import uvicorn

    # idemkit logs a one-time warning for InMemoryBackend and single-tenant mode; the bench
    # knows, and the log would only clutter the table.
    logging.getLogger("idemkit").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    uvicorn.run(
        build_app(kind, sqlite_url),
        host="127.0.0.1",
        port=port,
        workers=1,
        loop=loop,
        http=http_impl,
        log_level="warning",
        access_log=False,
    )


# --------------------------------------------------------------------------- clients


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def request(port: int, method: str, path: str, key: str | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        conn.request(method, path, body=BODY if method == "POST" else None, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def handler_runs(port: int) -> int:
    return int(json.loads(request(port, "GET", "/stats")[2])["runs"])


@dataclass
class Server:
    kind: str
    port: int
    proc: subprocess.Popen[bytes]

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.kind} exited with {self.proc.returncode}")
            try:
                handler_runs(self.port)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
            else:
                return

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_server(kind: str, sqlite_url: str, settings: Settings) -> Server:
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", kind, "--port", str(port)]
    cmd += ["--sqlite-url", sqlite_url, "--loop", settings.loop, "--http", settings.http]
    proc = subprocess.Popen(cmd)
    if settings.server_cpu is not None:
        os.sched_setaffinity(proc.pid, {settings.server_cpu})
    return Server(kind, port, proc)


def check_contract(server: Server) -> str | None:
    """A fresh key runs the handler once; its duplicate replays. None if all is well."""
    key = f"{RUN_ID}-check-{server.kind}"
    before = handler_runs(server.port)
    first = request(server.port, "POST", "/items", key)
    second = request(server.port, "POST", "/items", key)
    runs = handler_runs(server.port) - before
    if server.kind == "bare":
        return None if runs == 2 and first[0] == second[0] == 201 else "bare misbehaves"
    problems = []
    if first[0] != 201 or second[0] != 201:
        problems.append(f"statuses {first[0]}, {second[0]}")
    if runs != 1:
        problems.append(f"handler ran {runs} times for one key")
    if first[2] != second[2]:
        problems.append(f"replayed body differs ({first[2]!r} vs {second[2]!r})")
    if not any(second[1].get(h) == "true" for h in REPLAY_HEADERS):
        problems.append("no replay header on the duplicate")
    return "; ".join(problems) or None


# --------------------------------------------------------------------------- wrk


@dataclass
class Slice:
    rps: float
    requests: int
    non_2xx: int
    socket_errors: int


def run_wrk(
    port: int, script: Path, prefix: str, mode: str, settings: Settings, secs: int
) -> Slice:
    cmd = [
        settings.wrk,
        "-t1",
        f"-c{settings.connections}",
        f"-d{secs}s",
        "-s",
        str(script),
        f"http://127.0.0.1:{port}/items",
        "--",
        prefix,
        mode,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if settings.wrk_cpu is not None:
        os.sched_setaffinity(proc.pid, {settings.wrk_cpu})
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {err or out}")
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if rps is None or total is None:
        raise RuntimeError(f"cannot parse wrk output:\n{out}")
    return Slice(
        float(rps.group(1)),
        int(total.group(1)),
        int(non_2xx.group(1)) if non_2xx else 0,
        sum(int(g) for g in errors.groups()) if errors else 0,
    )


# --------------------------------------------------------------------------- scenarios


@dataclass
class Scenario:
    name: str
    server: Server
    mode: str  # "fresh" or "replay"
    replay_key: str = ""
    rps: list[float] = field(default_factory=list)
    requests: int = 0
    runs: int = 0
    non_2xx: int = 0
    socket_errors: int = 0
    _slices: Iterator[int] = field(default_factory=itertools.count)

    @property
    def median(self) -> float:
        return statistics.median(self.rps)

    def prefix(self) -> str:
        if self.mode == "replay":
            return self.replay_key
        return f"{RUN_ID}-{self.name}-{next(self._slices)}"

    def run(self, script: Path, settings: Settings, secs: int, *, record: bool) -> None:
        before = handler_runs(self.server.port)
        result = run_wrk(self.server.port, script, self.prefix(), self.mode, settings, secs)
        runs = handler_runs(self.server.port) - before
        if record:
            self.rps.append(result.rps)
            self.requests += result.requests
            self.runs += runs
            self.non_2xx += result.non_2xx
            self.socket_errors += result.socket_errors


SERVER_KINDS = ["bare", "idempo_memory", "idempo_sqlite", "idemkit", "aih"]

RATIOS: list[tuple[str, str]] = [
    ("idempo_memory", "bare"),
    ("idempo_sqlite", "bare"),
    ("idempo_memory_replay", "bare"),
    ("idempo_sqlite_replay", "bare"),
    ("idempo_memory", "idemkit"),
    ("idempo_memory_replay", "idemkit_replay"),
    ("idempo_memory", "aih"),
    ("idempo_memory_replay", "aih_replay"),
    ("idempo_sqlite", "idemkit"),
    ("idempo_sqlite", "aih"),
    ("idemkit", "bare"),
    ("aih", "bare"),
]


def build_scenarios(servers: list[Server]) -> list[Scenario]:
    scenarios = []
    for server in servers:
        scenarios.append(Scenario(server.kind, server, "fresh"))
        if server.kind != "bare":
            key = f"{RUN_ID}-{server.kind}-replay"
            status, _, body = request(server.port, "POST", "/items", key)
            if status != 201:
                raise RuntimeError(f"{server.kind}: priming the replay key gave {status}: {body!r}")
            scenarios.append(Scenario(f"{server.kind}_replay", server, "replay", key))
    return scenarios


def rotations(scenarios: list[Scenario], rounds: int) -> Iterator[list[Scenario]]:
    """Each round starts one scenario later, so none always runs first or after the same one."""
    for r in range(rounds):
        shift = r % len(scenarios)
        yield scenarios[shift:] + scenarios[:shift]


# --------------------------------------------------------------------------- reporting


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"python {sys.version.split()[0]}"]
    for dist in ("idempo", "idemkit", "asgi-idempotency-header", "starlette", "uvicorn"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist} missing")
    return ", ".join(parts)


def print_header(settings: Settings, slice_s: int) -> None:
    wrk_version = subprocess.run(
        [settings.wrk, "-v"], capture_output=True, text=True, check=False
    ).stdout.split(" [")[0]
    print(versions())
    pinning = (
        f"server on CPU {settings.server_cpu}, wrk on CPU {settings.wrk_cpu}"
        if settings.server_cpu is not None
        else "no CPU pinning"
    )
    print(
        f"uvicorn: 1 worker, loop={settings.loop}, http={settings.http}, no access log; "
        f"{wrk_version}: 1 thread, {settings.connections} keep-alive connections; {pinning}"
    )
    print(
        f"{settings.rounds} interleaved rounds x {slice_s} s per scenario after "
        f"{settings.warmup} s warm-up each (excluded)\n"
    )


def print_table(scenarios: list[Scenario]) -> None:
    print(f"{'scenario':<24}{'req/s':>9}{'min':>9}{'max':>9}{'runs/req':>10}{'non-2xx':>9}")
    for s in scenarios:
        runs_per_req = s.runs / s.requests if s.requests else float("nan")
        print(
            f"{s.name:<24}{s.median:>9.0f}{min(s.rps):>9.0f}{max(s.rps):>9.0f}"
            f"{runs_per_req:>10.2f}{s.non_2xx + s.socket_errors:>9}"
        )


def print_ratios(scenarios: list[Scenario]) -> None:
    by_name = {s.name: s for s in scenarios}
    print("\nratios of median req/s (same run; issue 15's goals in `make bench`'s table):")
    for top, bottom in RATIOS:
        label = f"{top} / {bottom}"
        if top in by_name and bottom in by_name:
            print(f"  {label:<44}{by_name[top].median / by_name[bottom].median:>7.2f}")
        else:
            print(f"  {label:<44}{'n/a':>7}")


# The rows of `make bench`'s table (bench/floor.py), with issue 15's goal for each: against
# the bare endpoint, memory fresh 0.6, replay 1.0, SQLite fresh 0.4 (its replay has none);
# against the peer asgi-idempotency-header, ahead on both.
REPORTED: list[tuple[str, str, float | None]] = [
    ("idempo_memory", "bare", 0.6),
    ("idempo_memory_replay", "bare", 1.0),
    ("idempo_sqlite", "bare", 0.4),
    ("idempo_sqlite_replay", "bare", None),
    ("idempo_memory", "aih", 1.0),
    ("idempo_memory_replay", "aih_replay", 1.0),
]


def report_ratios(scenarios: list[Scenario]) -> None:
    by_name = {s.name: s for s in scenarios}
    for top, bottom, goal in REPORTED:
        if top in by_name and bottom in by_name:
            ratio = by_name[top].median / by_name[bottom].median
            report_row("http", f"{top} / {bottom}: req/s under wrk", ratio, goal)


# --------------------------------------------------------------------------- main


@dataclass
class Settings:
    seconds: float
    rounds: int
    warmup: int
    connections: int
    loop: str
    http: str
    wrk: str
    server_cpu: int | None
    wrk_cpu: int | None


def default_impl(module: str, fast: str, fallback: str) -> str:
    import importlib.util

    return fast if importlib.util.find_spec(module) else fallback


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "--seconds", type=float, help="total timed seconds, split over all rounds and scenarios"
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds per scenario")
    parser.add_argument("--connections", type=int, default=32, help="wrk keep-alive connections")
    parser.add_argument("--quick", action="store_true", help="short smoke run (~45 s)")
    parser.add_argument("--loop", default=default_impl("uvloop", "uvloop", "asyncio"))
    parser.add_argument("--http", default=default_impl("httptools", "httptools", "h11"))
    parser.add_argument("--no-pin", action="store_true", help="do not pin server and wrk CPUs")
    # Internal: run one server (the bench starts itself once per server kind).
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sqlite-url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    wrk = shutil.which("wrk") or ""
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2
    common = {
        "connections": args.connections,
        "loop": args.loop,
        "http": args.http,
        "wrk": wrk,
        "server_cpu": cpus[0] if pin else None,
        "wrk_cpu": cpus[1] if pin else None,
    }
    if args.quick:
        return args, Settings(args.seconds or 27.0, args.rounds or 3, 1, **common)
    return args, Settings(args.seconds or 180.0, args.rounds or 5, 3, **common)


async def migrate(url: str) -> None:
    from idempo import open_async_store

    store = open_async_store(url)
    try:
        await store.migrate()
    finally:
        await store.aclose()


def run(settings: Settings) -> None:
    if not settings.wrk:
        raise SystemExit("wrk not found: install it (apt-get install wrk) and run again")
    with tempfile.TemporaryDirectory(prefix="idempo-bench-") as tmp:
        script = Path(tmp, "keys.lua")
        script.write_text(WRK_SCRIPT)
        sqlite_url = f"sqlite:///{tmp}/idempo.db"
        asyncio.run(migrate(sqlite_url))
        servers: list[Server] = []
        notes: list[str] = []
        try:
            for kind in SERVER_KINDS:
                servers.append(start_server(kind, sqlite_url, settings))
            for server in list(servers):
                try:
                    server.wait_ready()
                except Exception as exc:
                    # A peer that cannot start (e.g. a missing dependency) becomes a note.
                    notes.append(f"{server.kind}: not available ({exc}; see its stderr above)")
                    servers.remove(server)
                    server.stop()
                    continue
                problem = check_contract(server)
                if problem:
                    notes.append(f"{server.kind}: contract check failed: {problem}")
            scenarios = build_scenarios(servers)
            slice_s = max(1, round(settings.seconds / (settings.rounds * len(scenarios))))
            print_header(settings, slice_s)
            for scenario in scenarios:
                scenario.run(script, settings, settings.warmup, record=False)
            for order in rotations(scenarios, settings.rounds):
                for scenario in order:
                    scenario.run(script, settings, slice_s, record=True)
        finally:
            for server in servers:
                server.stop()

    print_table(scenarios)
    print_ratios(scenarios)
    report_ratios(scenarios)
    print(
        "\nruns/req: handler runs per completed request (fresh ~1.00, replay 0.00; requests "
        "in flight when a slice ends count as runs, not requests).\nnon-2xx: non-2xx answers "
        "plus wrk socket errors over all timed slices.\n"
    )
    print(PEERS)
    for note in notes:
        print(note)


def main(argv: list[str] | None = None) -> None:
    args, settings = parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.sqlite_url, args.loop, args.http)
        return
    run(settings)


if __name__ == "__main__":
    main()
