"""Keeping a lease alive while slow work runs (HTTP handlers, message handlers).

A holder slower than its lease would otherwise be taken over by a duplicate and run twice.
Renewal stops with the work, so a crashed process's key still frees when its last lease ends.

A refused renewal means another attempt took the key over: the work must learn it before its
next external call, or both attempts act. The attempt is marked (``attempt.lease_lost``; its
next ``renew()`` raises `FencedError`) and, in async code, the task that runs the work is
cancelled; leaving ``async with Renewal(...)`` (or `Renewal.fenced`) turns that cancellation
into the `FencedError`. A store fault only ends renewal, with a warning: the lease may still
hold, and the fenced outcome tells the holder if it did not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import Awaitable
from types import TracebackType
from typing import Protocol

from ..errors import FencedError
from .digest import key_digest, key_ref
from .keys import Scope


class Attempt(Protocol):
    """What a renewal needs of the guard's attempt: its scope, and a fenced ``renew``
    that marks the attempt lost when it is refused."""

    @property
    def scope(self) -> Scope: ...

    def renew(self) -> None: ...


class AsyncAttempt(Protocol):
    """The asynchronous twin of `Attempt`."""

    @property
    def scope(self) -> Scope: ...

    def renew(self) -> Awaitable[None]: ...


# Renewals still in flight when they were stopped: asyncio keeps only weak references to
# tasks, and these must finish (fenced out by then) rather than vanish.
_finishing: set[asyncio.Task[None]] = set()


class _Wheel:
    """The renewals due on one event loop, under one timer: the earliest's.

    Most work ends long before its first renewal is due, so starting and stopping one must
    cost little: a dict insert and a pop, where a timer of its own (``call_later``, a push
    on the loop's heap among every other timer, then its cancel) cost more than the rest of
    starting the work. Renewals of one period are kept in the order they fall due: each is
    due that period after it was added, and the loop's clock only goes forward.
    """

    __slots__ = ("at", "due", "loop", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.due: dict[float, dict[Renewal, float]] = {}  # period -> renewal -> when due
        self.timer: asyncio.TimerHandle | None = None
        self.at = math.inf  # when the timer fires

    def add(self, renewal: Renewal, every: float) -> None:
        at = self.loop.time() + every
        waiting = self.due.get(every)
        if waiting is None:
            waiting = self.due[every] = {}
        waiting[renewal] = at
        if at < self.at:
            self._arm(at)

    def discard(self, renewal: Renewal, every: float) -> None:
        waiting = self.due.get(every)
        if waiting is not None:
            waiting.pop(renewal, None)

    def _arm(self, at: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.at = at
        self.timer = self.loop.call_at(at, self._tick)

    def _tick(self) -> None:
        self.timer, self.at = None, math.inf
        now, earliest = self.loop.time(), math.inf
        for every, waiting in list(self.due.items()):
            while waiting:
                renewal, at = next(iter(waiting.items()))
                if at > now:
                    earliest = min(earliest, at)
                    break
                del waiting[renewal]
                renewal._due()
            if not waiting:
                del self.due[every]
        if earliest < math.inf:
            self._arm(earliest)


# Where a loop keeps its wheel: on the loop itself, so that the wheel, its timer and the
# renewals waiting in it live and die with the loop (a global table of loops would keep a
# closed loop alive through the renewals it still holds).
_ON_LOOP = "_idempo_renewals"


def _wheel(loop: asyncio.AbstractEventLoop) -> _Wheel:
    wheel: _Wheel | None = getattr(loop, _ON_LOOP, None)
    if wheel is None:
        wheel = _Wheel(loop)
        # A loop that takes no attributes gets a wheel per renewal: correct, only unshared.
        with contextlib.suppress(AttributeError):
            setattr(loop, _ON_LOOP, wheel)
    return wheel


class Renewal:
    """Extends an async attempt's lease every ``every`` seconds until stopped.

    Start it in the task that runs the work: that task is cancelled if the lease is lost.
    Most work finishes long before the first renewal is due, so it waits on the loop's one
    timer for renewals (`_Wheel`), and a task is only made when one is due.

        async with Renewal(attempt, every, logger):
            await work()        # a lost lease raises FencedError here
    """

    def __init__(self, attempt: AsyncAttempt, every: float, logger: logging.Logger) -> None:
        self._attempt = attempt
        self._every = every
        self._logger = logger
        self._stopped = False
        self._wheel: _Wheel | None = None
        self._task: asyncio.Task[None] | None = None
        self._work: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._cancelled_work = False

    def start(self) -> None:
        # The running loop asked once: on Python 3.11 every ask is a getpid() system call
        # (a fork check), and current_task() without a loop asks again.
        loop = asyncio.get_running_loop()
        self._work = asyncio.current_task(loop)
        if self._work is not None:
            self._cancelling = self._work.cancelling()
        self._wheel = _wheel(loop)
        self._wheel.add(self, self._every)

    def _schedule(self) -> None:
        assert self._wheel is not None  # set by start
        self._wheel.add(self, self._every)

    def _due(self) -> None:
        if not self._stopped:
            assert self._wheel is not None
            self._task = self._wheel.loop.create_task(self._renew())

    async def _renew(self) -> None:
        try:
            await self._attempt.renew()
        except FencedError as exc:
            if not self._stopped:
                _stopped_renewing(self._logger, self._attempt, exc)
                self._lost()
            return
        except Exception as exc:  # noqa: BLE001 - a store fault ends renewal, never the work
            if not self._stopped:
                _stopped_renewing(self._logger, self._attempt, exc)
            return
        if not self._stopped:
            self._schedule()

    def _lost(self) -> None:
        work = self._work
        if work is not None and not work.done():
            self._cancelled_work = True
            work.cancel(f"idempo: the lease of {key_ref(self._attempt.scope.key)} was taken over")

    async def stop(self) -> None:
        """Stop renewing. Never waits, so it is no cancellation point: a cancelled caller
        goes straight on to release its key. A renewal still in flight finishes by itself
        and changes nothing: renewals are fenced on the token and on the lease being live."""
        self._stopped = True
        if self._wheel is not None:
            self._wheel.discard(self, self._every)
        task, self._task = self._task, None
        if task is not None and not task.done():
            _finishing.add(task)
            task.add_done_callback(_finishing.discard)

    def fenced(self, exc: BaseException) -> BaseException:
        """What the work's exception means: the lost lease's `FencedError` if ``exc`` is the
        cancellation this renewal made (it is then taken back, as `asyncio.timeout` does
        with its own), else ``exc`` itself. Call it once, after `stop`."""
        if not self._cancelled_work or not isinstance(exc, asyncio.CancelledError):
            return exc
        self._cancelled_work = False
        assert self._work is not None
        if self._work.uncancel() > self._cancelling:
            return exc  # someone else cancelled the work too: theirs goes on
        lost = FencedError(f"the lease of {key_ref(self._attempt.scope.key)} was taken over")
        lost.__cause__ = exc
        return lost

    def outcome(self, exc: BaseException | None) -> BaseException | None:
        """What the work's ending means, after `stop`: ``exc`` itself, or the lost lease's
        `FencedError` when the cancellation behind it (or one the work swallowed) was this
        renewal's."""
        if exc is None and self._cancelled_work:
            exc = asyncio.CancelledError()  # the work swallowed it; the lease is lost all the same
        return exc if exc is None else self.fenced(exc)

    async def __aenter__(self) -> Renewal:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
        meant = self.outcome(exc)
        if meant is not exc and isinstance(meant, FencedError):
            raise meant


class ThreadRenewal:
    """The synchronous twin of `Renewal`: a daemon thread renews while the work runs. A lost
    lease marks the attempt (``attempt.lease_lost``); its next ``renew()`` raises."""

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
                self._attempt.renew()  # a refusal marks the attempt
            except Exception as exc:  # noqa: BLE001 - see Renewal._renew
                _stopped_renewing(self._logger, self._attempt, exc)
                return

    def stop(self) -> None:
        """Stop renewing; waits for a renewal in flight."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> ThreadRenewal:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _stopped_renewing(
    logger: logging.Logger, attempt: Attempt | AsyncAttempt, exc: Exception
) -> None:
    logger.warning(
        "idempo: stopped renewing the lease of %s: %s",
        key_ref(attempt.scope.key),
        exc,
        extra={"idempo_key_digest": key_digest(attempt.scope.key)},
    )
