"""The transactional outbox, bound to the idempotency record.

A guarded block in transactional mode stages messages on its connection; they commit with
its business writes and its stored result, or not at all, and a replay stages nothing (it
does not run the block). A relay publishes them afterwards, with an id derived from the
idempotency scope, so a consumer that deduplicates on the id applies each once:

    from idempo.outbox import Relay, stage

    with idem.once(key, operation="capture", payload=order, conn=conn) as attempt:
        if not attempt.replayed:
            conn.execute("UPDATE payments SET captured = 1 WHERE id = ?", (order["id"],))
            stage(conn, attempt, "payments", {"event": "payment.captured", "id": order["id"]})
            attempt.result = {"captured": order["id"]}

    await Relay("sqlite:///app.db", publisher).drain()

See docs/outbox.md.
"""

from ._message import OutboxMessage, Publisher
from ._sql import DEFAULT_TABLE, outbox_table
from ._stage import Outbox, astage, encode_body, message_id, stage
from .relay import Drained, Relay, exponential_backoff

__all__ = [
    "DEFAULT_TABLE",
    "Drained",
    "Outbox",
    "OutboxMessage",
    "Publisher",
    "Relay",
    "astage",
    "encode_body",
    "exponential_backoff",
    "message_id",
    "outbox_table",
    "stage",
]
