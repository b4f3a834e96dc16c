"""Spawned consumer processes for the tests that must really race another process or really
die (SIGKILL) mid-handler, and the messages they send back.

A plain module (spawned children import their target by module name). The target is called
as ``target(spec, said, stop)``: ``spec`` is picklable data, ``said`` a queue to put
``{"worker": ..., "state": ...}`` dicts on, ``stop`` an event set when it should finish.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHILD_TIMEOUT = 60.0  # a spawned child imports its broker client, psycopg and idempo first


class Children:
    """Spawned consumer processes running ``target`` and the messages they send."""

    def __init__(self, target: Callable[[Any, Any, Any], None]) -> None:
        self.target = target
        self.context = multiprocessing.get_context("spawn")
        self.said: Any = self.context.Queue()
        # One stop event each: a child killed while waiting on an event leaves it unusable
        # (setting it would wait for the dead sleeper), so only the living are told to stop.
        self.processes: dict[str, tuple[Any, Any]] = {}

    def start(self, worker: str, spec: Any) -> None:
        stop = self.context.Event()
        process = self.context.Process(target=self.target, args=(spec, self.said, stop))
        process.start()
        self.processes[worker] = (process, stop)

    def message(self) -> dict[str, Any]:
        try:
            message: dict[str, Any] = self.said.get(timeout=CHILD_TIMEOUT)
        except queue.Empty:
            dead = {w: p.exitcode for w, (p, _) in self.processes.items() if not p.is_alive()}
            pytest.fail(f"no word from the children for {CHILD_TIMEOUT}s (exited: {dead})")
        return message

    async def until(self, state: str) -> dict[str, Any]:
        """The next message in ``state``, skipping the others."""
        while (message := await asyncio.to_thread(self.message)).get("state") != state:
            pass
        return message

    def kill(self, worker: str) -> None:
        process, _ = self.processes.pop(worker)
        process.kill()  # SIGKILL
        process.join(timeout=10)
        assert process.exitcode == -9

    def stop(self, worker: str) -> None:
        """Tell one child to finish, and wait until it has."""
        process, stop = self.processes.pop(worker)
        stop.set()
        process.join(timeout=30)
        assert process.exitcode == 0

    def close(self) -> None:
        for _, stop in self.processes.values():
            stop.set()
        for process, _ in self.processes.values():
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
        self.said.close()
        self.said.join_thread()


@contextmanager
def spawned(target: Callable[[Any, Any, Any], None]) -> Iterator[Children]:
    """`Children` running ``target``, all stopped (or killed) and reaped at the end."""
    children = Children(target)
    try:
        yield children
    finally:
        children.close()
