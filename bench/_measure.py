"""What the bench scripts share: counting instructions under callgrind, and a PostgreSQL
store in a schema of its own that is dropped afterwards."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any


def callgrind_count(valgrind: str, script: str, args: list[str]) -> int:
    """The instructions ``python script *args`` runs under ``valgrind --tool=callgrind``."""
    with tempfile.TemporaryDirectory(prefix="idempo-callgrind-") as tmp:
        out = Path(tmp, "callgrind.out")
        cmd = [valgrind, "--tool=callgrind", f"--callgrind-out-file={out}"]
        cmd += [sys.executable, script, *args]
        # Hash randomisation changes dict layouts, and with them the counts.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        summary = re.search(r"^summary:\s+(\d+)", out.read_text(), re.MULTILINE)
        if summary is None:
            raise RuntimeError("no summary line in callgrind's output")
        return int(summary.group(1))


def scratch_postgres_store(stack: ExitStack, dsn: str, kind: Any = None) -> Any:
    """A migrated `PostgresStore` (or ``kind``, a subclass) in a fresh schema, closed and
    dropped when ``stack`` ends."""
    import psycopg

    from idempo.stores.postgres import PostgresStore

    schema = f"bench_{secrets.token_hex(4)}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")

    def drop() -> None:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")

    stack.callback(drop)
    store = (kind or PostgresStore)(dsn, table=f"{schema}.idempo_records", max_size=2)
    stack.callback(store.close)
    store.migrate()
    return store


def server_cpu_ns(command: str) -> int | None:
    """The CPU time so far, in ns, of every process of this host whose command is
    ``command`` (a server on loopback: its postmaster, backends and background writers
    together), from ``/proc/<pid>/schedstat``; None where none can be read (a server on
    another host, a system without /proc). Processes that ended between two readings take
    their time with them, so a scenario measured this way keeps its connections open."""
    total, found = 0, False
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/comm", encoding="ascii") as comm:
                if comm.read().strip() != command:
                    continue
            with open(f"/proc/{entry.name}/schedstat", encoding="ascii") as stat:
                total += int(stat.read().split()[0])
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
        found = True
    return total if found else None
