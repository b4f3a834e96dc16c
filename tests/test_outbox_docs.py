"""docs/outbox.md runs as written, up to its Publishers section (helper C's, tested with the
publishers): its ```python blocks in order, in one namespace, in a fresh
directory (the FastAPI block calls its own endpoint, as a client and its retry would), and its
```console lines through the ``idempo`` command (the broker is a recording publisher: the
real brokers are tests/test_outbox_e2e*.py's)."""

from __future__ import annotations

import asyncio
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from idempo.cli import app as cli
from idempo.outbox import Outbox, OutboxMessage, Publisher
from idempo.stores.sqlite import SQLiteStore

DOC = Path(__file__).parent.parent / "docs" / "outbox.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(language: str) -> list[str]:
    """The page's blocks in ``language`` up to its "Publishers" section (the brokers' part,
    whose blocks run in the publishers' own tests)."""
    text = DOC.read_text()
    core = text[: text.index("\n## Publishers\n")]
    return [code for lang, code in FENCE.findall(core) if lang == language]


class Recording:
    def __init__(self) -> None:
        self.published: list[OutboxMessage] = []

    async def publish(self, message: OutboxMessage) -> None:
        self.published.append(message)

    async def aclose(self) -> None:
        pass


async def _lifespan(namespace: dict[str, Any]) -> None:
    async with namespace["lifespan"](namespace["app_with_relay"]):
        await asyncio.sleep(0)


def test_the_page_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    python = blocks("python")
    assert len(python) == 5
    staging, beside, fastapi, relay, lifespan = python
    namespace: dict[str, Any] = {}
    for code in (staging, beside, fastapi):  # the last one calls its endpoint twice
        exec(compile(code, str(DOC), "exec"), namespace)  # the page's own code

    exec(compile(relay, str(DOC), "exec"), namespace)
    shown = capsys.readouterr().out
    assert "Drained(sent=2, failed=0)" in shown
    assert shown.count("published payments") == 2
    assert '"event":"payment.captured","order_id":"order-1","amount":1999' in shown
    assert '"event":"payment.captured","order_id":"order-2","amount":500' in shown

    exec(compile(lifespan, str(DOC), "exec"), namespace)
    asyncio.run(_lifespan(namespace))
    asyncio.run(namespace["engine"].dispose())
    namespace["conn"].close()
    namespace["store"].close()

    from idempo.outbox import publishers

    recording = Recording()

    def open_publisher(url: str, **options: Any) -> Publisher:
        assert url == "redis://127.0.0.1:6379/0"
        return recording

    monkeypatch.setattr(publishers, "open_publisher", open_publisher)
    runner = CliRunner()
    (console,) = blocks("console")
    for line in console.splitlines():
        if not line.startswith("$ "):
            continue  # the page's marker: "continues the block above"
        result = runner.invoke(cli, shlex.split(line.removeprefix("$ "))[1:])
        assert result.exit_code == 0, (line, result.output)
    assert recording.published == []  # the relay above had sent everything
    store = SQLiteStore("shop.db")
    try:
        assert Outbox().stats(store) == {"pending": 0, "failing": 0, "sent": 0}
    finally:
        store.close()
