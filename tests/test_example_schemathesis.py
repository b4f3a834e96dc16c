"""A bounded schemathesis run against the example API's own OpenAPI document, over real HTTP
to a real uvicorn server: no 5xx, and every answer conforms to the document. The document
declares the Idempotency-Key (idempo.contrib.fastapi), so the generated requests carry keys:
fresh ones, and ones hypothesis sends again with the same or another body."""

from __future__ import annotations

from pathlib import Path

import schemathesis

from idempo.contrib.fastapi import KEY_PATTERN
from idempo.example.server import ExampleServer
from schemathesis_runs import explore

# Asked-for failures and long sleeps are the demo's own knobs, not inputs to explore: a 503
# from X-Demo-Fail is the contract, and a 60 s delay would only slow the run.
DEMO_KNOBS = ("X-Demo-Fail", "X-Demo-Delay-Ms")
EXAMPLES_PER_OPERATION = 60


def test_example_api_conforms_to_its_openapi_document(tmp_path: Path) -> None:
    server = ExampleServer(f"sqlite:///{tmp_path / 'api.db'}", tmp_path / "server.log")
    server.start()
    try:
        schema = schemathesis.openapi.from_url(f"{server.base}/openapi.json")
        create = schema.raw_schema["paths"]["/payments"]["post"]
        (key,) = [p for p in create["parameters"] if p["name"] == "Idempotency-Key"]
        assert key["required"] is True
        assert key["schema"]["pattern"] == KEY_PATTERN
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) == 3
        for operation in operations:
            explore(operation, EXAMPLES_PER_OPERATION, without_headers=DEMO_KNOBS)
    finally:
        server.stop()
