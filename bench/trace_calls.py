"""How a guarded call travels through idempo's modules: module changes and function entries.

Two calls are traced, each after a warm-up call of its own kind (so imports, prepared
statements and caches are in place):

    postgres_tx   ``Idempotency(PostgresStore(...)).once(key, conn=psycopg_conn)``: one
                  transactional call on the app's psycopg connection
    asgi_memory   one POST through ``idempo.asgi.IdempotencyMiddleware`` on a memory store
    asgi_sqlite   the same on a SQLite store

``sys.setprofile`` sees every Python function entered and left. Only idempo's own frames
count: a *function entry* is a call of an idempo function (a generator's resumption counts,
as it enters the frame again), and a *module change* is an entry into an idempo module other than
its caller's (the nearest idempo frame below it, past psycopg's or the stdlib's).

    python bench/trace_calls.py [--dsn URL] [--only postgres_tx] [--entries]

``--entries`` also prints the idempo functions entered, in order, with the module changes
marked. Run it on the baseline tree with ``PYTHONPATH=/work/baseline/src``.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"


def _module(frame: FrameType | None) -> str | None:
    """The idempo module of ``frame`` or of its nearest caller in idempo, if any."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("idempo"):
            return str(name)
        frame = frame.f_back
    return None


@dataclass
class Trace:
    """What one traced call did inside idempo."""

    entries: list[str] = field(default_factory=list)  # "* module:function", * on a change
    changes: int = 0

    def profiler(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("idempo"):
            return
        caller = _module(frame.f_back)
        changed = caller is not None and caller != module
        self.changes += changed
        self.entries.append(f"{'*' if changed else ' '} {module}:{frame.f_code.co_qualname}")


@contextmanager
def traced() -> Iterator[Trace]:
    trace = Trace()
    sys.setprofile(trace.profiler)
    try:
        yield trace
    finally:
        sys.setprofile(None)


def postgres_tx(dsn: str) -> Trace:
    import psycopg

    from idempo import Idempotency
    from idempo.stores.postgres import PostgresStore

    schema = f"trace_{secrets.token_hex(4)}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
        admin.execute(f"CREATE TABLE {schema}.business (k text)")
    store = PostgresStore(dsn, table=f"{schema}.idempo_records", max_size=2)
    try:
        store.migrate()
        idem = Idempotency(store)
        with psycopg.connect(dsn) as conn:

            def call() -> None:
                key = secrets.token_hex(8)
                with idem.once(key, operation="trace", payload={"n": 1}, conn=conn) as attempt:
                    if not attempt.replayed:
                        conn.execute(f"INSERT INTO {schema}.business VALUES (%s)", (key,))
                        attempt.result = {"ok": True}

            call()
            with traced() as trace:
                call()
        return trace
    finally:
        store.close()
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")


def _asgi(url: Callable[[str], str]) -> Callable[[str], Trace]:
    def run(_dsn: str) -> Trace:
        sys.path.insert(0, str(Path(__file__).parent))
        from asgi_overhead import scope_for  # the overhead bench's request, not a copy
        from idempo.asgi import IdempotencyMiddleware
        from idempo.stores import open_async_store

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await receive()
            await send({"type": "http.response.start", "status": 201, "headers": []})
            await send({"type": "http.response.body", "body": b'{"id":1}'})

        async def go(tmp: str) -> Trace:
            store = open_async_store(url(tmp))
            if hasattr(store, "migrate"):
                await store.migrate()
            middleware = IdempotencyMiddleware(app, store=store)

            async def request() -> None:
                body = b'{"name":"widget"}'

                async def receive() -> dict[str, Any]:
                    return {"type": "http.request", "body": body, "more_body": False}

                async def send(_message: dict[str, Any]) -> None:
                    return None

                await middleware(scope_for(secrets.token_hex(8).encode()), receive, send)

            await request()
            with traced() as trace:
                await request()
            await store.aclose()
            return trace

        with tempfile.TemporaryDirectory(prefix="idempo-trace-") as tmp:
            return asyncio.run(go(tmp))

    return run


SCENARIOS: dict[str, Callable[[str], Trace]] = {
    "postgres_tx": postgres_tx,
    "asgi_memory": _asgi(lambda _tmp: "memory://"),
    "asgi_sqlite": _asgi(lambda tmp: f"sqlite:///{tmp}/trace.db"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--dsn", default=DEFAULT_DSN)
    parser.add_argument("--only", help="comma-separated scenarios: " + ", ".join(SCENARIOS))
    parser.add_argument("--entries", action="store_true", help="list the functions entered")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(SCENARIOS)
    print(f"{'scenario':<14}{'module changes':>16}{'function entries':>18}")
    traces = {name: SCENARIOS[name](args.dsn) for name in names}
    for name, trace in traces.items():
        print(f"{name:<14}{trace.changes:>16}{len(trace.entries):>18}")
    for name, trace in traces.items():
        by_module = Counter(entry[2:].split(":", 1)[0] for entry in trace.entries)
        print(
            f"\n{name}: entries by module: "
            + ", ".join(f"{m} {n}" for m, n in by_module.most_common())
        )
        if args.entries:
            print("\n".join(trace.entries))


if __name__ == "__main__":
    main()
