"""The Celery app that tests/test_celery.py runs real workers on (``celery -A celery_tasks
worker``), and publishes with in the test process.

A plain module: a worker imports it by name and builds its app from the JSON in
IDEMPO_CELERY_CONFIG (the broker, the test's PostgreSQL schema, the mode, the lease); the test
process calls `make_app` with the same config. The tasks' effect is a row in the schema's
``effects`` table, written on the delivery's connection (no unique key: a second execution
shows as a second row). A task whose key is the config's ``hang`` key stops inside its body,
row written but not committed, after saying so with a marker file, the first time only: the
test SIGKILLs the worker (or its pool's child) there.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_ready
from psycopg_pool import ConnectionPool

from idempo import Idempotency, Policy
from idempo.consumer import Consumer, current_delivery
from idempo.contrib.celery import idempotent_task
from idempo.stores.postgres import PostgresStore

TTL = timedelta(days=8)
HORIZON = timedelta(days=7)
HANG_BOUND = 60.0  # seconds a hanging body waits to be killed before it gives up


def make_app(config: dict[str, Any]) -> Celery:
    """The app, its two tasks and their consumers, as ``config`` sets them up."""
    app = Celery("celery_tasks", set_as_current=False)
    transport: dict[str, Any] = {}
    if config["broker"].startswith("redis"):
        transport = {
            "global_keyprefix": f"{config['prefix']}:",
            "visibility_timeout": config.get("visibility_timeout", 60),
            # Look for deliveries of dead workers every second, not every 100.
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        }
    app.conf.update(
        broker_url=config["broker"],
        result_backend=config["backend"],
        result_expires=600,
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        task_default_queue=config["prefix"],
        task_default_exchange=config["prefix"],
        task_default_routing_key=config["prefix"],
        worker_enable_remote_control=False,
        worker_send_task_events=False,
    )
    database, schema = config["database"], config["schema"]
    markers = Path(config["markers"])

    def consumer(name: str) -> Consumer:
        """Made once per worker process (the prefork pool's children each make theirs)."""
        pool: ConnectionPool[Any] = ConnectionPool(database, min_size=1, max_size=2)
        store = PostgresStore(pool, table=f"{schema}.idempo_records")
        policy = Policy(ttl=TTL, lease=timedelta(seconds=config.get("lease", 30)))
        return Consumer(
            Idempotency(store, policy),
            name=name,
            horizon=HORIZON,
            connection=pool.connection,
            mode=config.get("mode", "transactional"),
            retry_delay=0.1,
        )

    def effect(key: str) -> None:
        delivery = current_delivery()
        assert delivery is not None
        delivery.conn.execute(
            f"INSERT INTO {schema}.effects VALUES (%s, %s, %s, %s)",
            (key, config.get("worker", "?"), delivery.attempt.token, os.getpid()),
        )
        if key == config.get("hang"):
            try:
                with (markers / f"inside-{key}").open("x") as inside:
                    inside.write(str(os.getpid()))
            except FileExistsError:
                return  # the redelivery after the kill: carry on
            deadline = time.monotonic() + HANG_BOUND
            while time.monotonic() < deadline:  # killed here, the row not committed
                time.sleep(0.05)
        time.sleep(config.get("slow", 0.0))

    # Retries: a copy that finds its payment in progress waits for it (task.retry).
    @app.task(
        name="idempo_test.charge",
        shared=False,
        acks_late=True,
        reject_on_worker_lost=True,
        max_retries=100,
    )
    @idempotent_task(lambda: consumer("test.charge"), key="payment_id")
    def charge(payment_id: str, amount: int) -> dict[str, Any]:
        effect(payment_id)
        return {"charged": payment_id, "amount": amount}

    @app.task(name="idempo_test.ship", shared=False, bind=True, acks_late=True, max_retries=100)
    @idempotent_task(lambda: consumer("test.ship"))
    def ship(self: Any, order: dict[str, Any]) -> dict[str, Any]:
        effect(self.request.headers["idempotency_key"])
        return {"shipped": order["id"]}

    return app


def _ready(sender: Any = None, **_: Any) -> None:
    """Tell the test this worker consumes: a file named after it."""
    ready = os.environ.get("IDEMPO_CELERY_READY")
    if ready:
        Path(ready).write_text(str(os.getpid()))


if os.environ.get("IDEMPO_CELERY_CONFIG"):  # a worker: `celery -A celery_tasks worker`
    app = make_app(json.loads(os.environ["IDEMPO_CELERY_CONFIG"]))
    worker_ready.connect(_ready, weak=False)
