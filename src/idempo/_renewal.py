"""Keeping a lease alive while slow work runs (HTTP handlers, message handlers).

A holder slower than its lease would otherwise be taken over by a duplicate and run twice.
Renewal stops with the work, so a crashed process's key still frees when its last lease ends.
A lost lease or a store fault ends renewal with a warning, never the work: the fenced outcome
then tells the holder it lost the key.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from .guard import AsyncAttempt, Attempt


class Renewal:
    """Extends an async attempt's lease every ``every`` seconds until stopped.

    Most work finishes long before the first renewal is due, so a timer waits for it, and a
    task is only made when one is.
    """

    def __init__(self, attempt: AsyncAttempt, every: float, logger: logging.Logger) -> None:
        self._attempt = attempt
        self._every = every
        self._logger = logger
        self._stopped = False
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._every, self._due)

    def _due(self) -> None:
        if not self._stopped:
            self._task = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        try:
            await self._attempt.renew()
        except Exception as exc:  # noqa: BLE001 - a lost lease or a store fault ends renewal, never the work
            _stopped_renewing(self._logger, self._attempt, exc)
            return
        if not self._stopped:
            self.start()

    async def stop(self) -> None:
        """Stop renewing; waits for a renewal in flight rather than cancelling it mid-query."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
        task, self._task = self._task, None
        if task is not None:
            await task


class ThreadRenewal:
    """The synchronous twin of `Renewal`: a daemon thread renews while the work runs."""

    def __init__(self, attempt: Attempt, every: float, logger: logging.Logger) -> None:
        self._attempt = attempt
        self._every = every
        self._logger = logger
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idempo-renewal", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._every):
            try:
                self._attempt.renew()
            except Exception as exc:  # noqa: BLE001 - see Renewal._renew
                _stopped_renewing(self._logger, self._attempt, exc)
                return

    def stop(self) -> None:
        """Stop renewing; waits for a renewal in flight."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()


def _stopped_renewing(logger: logging.Logger, attempt: Attempt, exc: Exception) -> None:
    logger.warning("idempo: stopped renewing the lease of key %r: %s", attempt.scope.key, exc)
