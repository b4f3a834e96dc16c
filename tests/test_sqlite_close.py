"""Closing a SQLite store while a cancelled caller's write still runs in its worker thread.

sqlite3 closing a connection under a running statement crashes the process (a relay on SQLite
stopped mid-batch did): `close` waits for the write to end first. The test runs in a child
process, so a crash fails it instead of killing the test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import asyncio, sys, threading, time
    from idempo.stores._sql.dialect import Statement
    from idempo.stores.sqlite import AsyncSQLiteStore

    inside = threading.Event()
    finished = []

    def slow():
        rows = yield Statement("SELECT 1", {})
        inside.set()
        for n in range(200):  # statements on the worker's connection, past the close
            rows = yield Statement("SELECT count(*) FROM idempo_records", {})
            time.sleep(0.001)
        finished.append(True)
        return rows

    async def main():
        store = AsyncSQLiteStore(sys.argv[1])
        await store.migrate()
        task = asyncio.ensure_future(store.run(slow()))
        while not inside.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.aclose()  # the worker thread is still writing
        print("closed after the write", bool(finished))

    asyncio.run(main())
    """
)


def test_close_waits_for_a_write_still_running_in_a_worker_thread(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "idempo.db")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "closed after the write True"
