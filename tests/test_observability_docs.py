"""docs/observability.md runs as written: its python blocks (each a program, or continuing
the one above, as tests/test_docs.py runs them), and every series its PromQL queries name
is one a real scrape of idempo's metrics exposes."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from idempo import Idempotency, Policy
from idempo.errors import FencedError
from idempo.otel import OpenTelemetryObserver, prometheus_meter_provider
from idempo.stores.memory import MemoryStore
from idempo.testing import FakeClock

DOC = Path(__file__).parent.parent / "docs" / "observability.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(language: str) -> list[str]:
    return [code for lang, code in FENCE.findall(DOC.read_text()) if lang == language]


def test_the_python_blocks_run(capsys: pytest.CaptureFixture[str]) -> None:
    snippets = blocks("python")
    assert len(snippets) >= 5
    namespace: dict[str, object] = {}
    for code in snippets:
        if not code.startswith("# continues the block above"):
            namespace = {"__name__": "__main__"}  # a program of its own (tests/test_docs.py)
        exec(compile(code, str(DOC), "exec"), namespace)  # the page's own code
    assert "idempo charge" in capsys.readouterr().out


def test_the_queries_name_metrics_that_exist() -> None:
    """Each ``idempo_*`` series (and label) a query reads is in a scrape, after the decisions
    that make every one of them appear: a takeover, a fenced write, a wait."""
    (queries,) = blocks("promql")
    named = set(re.findall(r"\b(idempo_[a-z_]+?)(?:_bucket)?\b", queries))
    registry = CollectorRegistry()
    provider = prometheus_meter_provider(registry)
    clock = FakeClock()
    idem = Idempotency(
        MemoryStore(),
        Policy(clock=clock, wait=None),
        observers=[OpenTelemetryObserver(meter_provider=provider, spans=False)],
    )
    stale = idem.begin("k-1", operation="charge")
    clock.advance(idem.policy.lease * 2)
    with idem.once("k-1", operation="charge") as attempt:
        attempt.result = 1
    with pytest.raises(FencedError):
        stale.finish(2)
    with pytest.raises(FencedError):
        stale.attempt.renew()  # a lost lease: counted as uncertain
    waiting = idem.begin("k-2", operation="charge")
    waiter = Idempotency(
        idem.store,
        Policy(clock=clock, wait=idem.policy.lease, sleep=lambda s: waiting.finish(3)),
        observers=idem.observers,
    )
    with waiter.once("k-2", operation="charge") as attempt:
        assert attempt.replayed
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        provider.shutdown()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    exposed = {sample.name.removesuffix("_bucket") for sample in samples}
    labels = {label for sample in samples for label in sample.labels}
    series = {name for name in named if name.endswith(("_total", "_seconds"))}
    assert series, "the queries name no idempo series"
    assert series <= exposed, series - exposed
    assert named - series <= labels, named - series - labels
