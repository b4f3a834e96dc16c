"""Who holds a leased unit on the app's connection (`_caller`): the thread and the asyncio
task that reserved, told apart from any later task, and not kept alive by the unit."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest

from idempo.stores._sql.transaction import _caller

pytestmark = pytest.mark.anyio


async def test_the_same_task_is_the_caller_and_another_is_not() -> None:
    owner = _caller()
    assert _caller() == owner

    async def other() -> Any:
        return _caller()

    assert await asyncio.create_task(other()) != owner


async def test_a_task_made_after_the_owner_ended_is_not_the_owner() -> None:
    async def reserve() -> Any:
        return _caller()

    owner = await asyncio.create_task(reserve())
    await asyncio.sleep(0)  # the loop lets go of the ended task once it turns
    gc.collect()
    # The owner task ended and nothing keeps it: its reference is dead. Tasks made now may
    # take its address, as the renewal's did; none of them is the owner.
    assert owner[1] is not None
    assert owner[1]() is None
    for _ in range(50):
        assert await asyncio.create_task(reserve()) != owner


async def test_the_unit_does_not_keep_the_owner_task_alive() -> None:
    async def reserve() -> Any:
        return _caller()

    task = asyncio.create_task(reserve())
    owner = await task
    assert owner[1] is not None
    assert owner[1]() is task
    del task
    await asyncio.sleep(0)  # the loop lets go of the ended task once it turns
    gc.collect()
    assert owner[1]() is None


def test_threads_without_a_loop() -> None:
    owner = _caller()
    assert owner[1] is None
    assert _caller() == owner
    found: list[Any] = []
    thread = threading.Thread(target=lambda: found.append(_caller()))
    thread.start()
    thread.join()
    assert found[0] != owner
