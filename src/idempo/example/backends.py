"""Where the example payments API keeps its data: next to the idempotency records.

One ``--store`` URL is the whole state. On SQLite and PostgreSQL the payments, the simulated
payment provider's tables, the outbox and the records share one database, so the payment row,
its "payment.captured" event and the stored response commit in one transaction. On Redis
they share one Redis database, and the payment write is idempotent by construction (a
deterministic id), because Redis cannot put it in the record's transaction
(docs/guarantees.md, the two-system gap); for the same reason there is no outbox there, and
no event is staged on Redis.

The payment provider (PSP) is a separate system: it writes outside the business transaction
and deduplicates charges by the idempotency key the API derives for it, as Stripe or Adyen do.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from starlette.requests import Request

from ..contrib.starlette import idempotent_connection
from ..errors import ConfigurationError
from ..outbox import Outbox, OutboxMessage, outbox_table

__all__ = ["Backend", "Charge", "Ledger", "Payment", "open_backend"]

DECLINED_SUFFIX = "0002"  # the test card that the provider always declines


@dataclass(frozen=True, slots=True)
class Payment:
    id: str
    amount: int
    currency: str
    status: str
    charge_id: str


@dataclass(frozen=True, slots=True)
class Charge:
    """The provider's answer: a charge id, or a decline (``charge_id`` None)."""

    charge_id: str | None
    decline_code: str | None = None


@dataclass(frozen=True, slots=True)
class Ledger:
    """What happened, counted from the data itself rather than from anyone's say-so."""

    payments: int
    charges: int
    psp_calls: int
    double_charges: int
    events: int

    def as_json(self) -> dict[str, int]:
        return asdict(self)


class Backend(Protocol):
    """The example's data layer: one per store kind."""

    async def setup(self) -> None: ...

    async def charge(
        self, psp_key: str, reference: str, amount: int, currency: str, card: str
    ) -> Charge:
        """Ask the provider to charge; a repeated ``psp_key`` returns the first answer."""

    def connection(self, request: Request) -> Any:
        """A FastAPI dependency: the connection the endpoint writes on, if any."""

    async def add_payment(self, conn: Any, payment: Payment) -> None:
        """Write the payment on ``conn``, what `connection` gave."""

    async def stage_event(
        self, conn: Any, attempt: Any, destination: str, event: dict[str, Any]
    ) -> OutboxMessage | None:
        """Stage ``event`` in the outbox on ``conn``, in the payment's transaction (None
        where the store has no transaction to share, and so no outbox)."""

    async def migrate(self, store: Any) -> None:
        """Create the outbox table beside the store's records, where there is one."""

    async def payment(self, payment_id: str) -> Payment | None: ...

    async def ledger(self) -> Ledger: ...

    def middleware_options(self) -> dict[str, Any]:
        """Extra IdempotencyMiddleware options (the connection to ride on)."""

    async def aclose(self) -> None: ...


def _provider_answer(psp_key: str, card: str) -> Charge:
    if card.endswith(DECLINED_SUFFIX):
        return Charge(None, "generic_decline")
    # The charge id is the provider's own, derived from the key it deduplicates on.
    return Charge("ch_" + uuid.uuid5(uuid.NAMESPACE_URL, f"psp:{psp_key}").hex[:24])


class SqlBackend:
    """SQLite, PostgreSQL or MariaDB through SQLAlchemy's async engine (aiosqlite, psycopg,
    aiomysql)."""

    def __init__(self, store_url: str, table: str) -> None:
        from sqlalchemy.ext.asyncio import create_async_engine  # noqa: PLC0415 - demo extra

        scheme, _, rest = store_url.split("?", 1)[0].partition(":")
        if scheme == "sqlite":
            # The same slashes rule as idempo's (and SQLAlchemy's) sqlite URLs.
            engine_url = f"sqlite+aiosqlite:{rest}"
            options: dict[str, Any] = {"connect_args": {"timeout": 30}}
        elif scheme.startswith(("mysql", "mariadb")):
            engine_url = f"mysql+aiomysql:{rest}"
            options = {"pool_size": 20, "max_overflow": 20}
        else:
            engine_url = f"postgresql+psycopg:{rest}"
            options = {"pool_size": 20, "max_overflow": 20}
        self.engine = create_async_engine(engine_url, **options)
        self.mariadb = scheme.startswith(("mysql", "mariadb"))
        # MariaDB keys need a length, and it spells "insert unless present" its own way.
        self._key = "VARCHAR(255)" if self.mariadb else "TEXT"
        schema, _, _ = table.rpartition(".")
        prefix = f"{schema}." if schema else ""
        self.payments = f"{prefix}demo_payments"
        self.charges = f"{prefix}demo_psp_charges"
        self.calls = f"{prefix}demo_psp_calls"
        self.outbox = Outbox(outbox_table(table))

    async def setup(self) -> None:
        from sqlalchemy import text  # noqa: PLC0415

        # No unique constraint on payments: a double execution would show as a second row.
        statements = [
            f"CREATE TABLE IF NOT EXISTS {self.payments} (id TEXT NOT NULL, amount BIGINT"
            " NOT NULL, currency TEXT NOT NULL, charge_id TEXT NOT NULL)",
            f"CREATE TABLE IF NOT EXISTS {self.charges} (idempotency_key {self._key} PRIMARY KEY,"
            " reference TEXT NOT NULL, amount BIGINT NOT NULL, currency TEXT NOT NULL,"
            " charge_id TEXT, decline_code TEXT)",
            f"CREATE TABLE IF NOT EXISTS {self.calls} (idempotency_key TEXT NOT NULL)",
        ]
        async with self.engine.begin() as conn:
            for statement in statements:
                await conn.execute(text(statement))

    async def charge(
        self, psp_key: str, reference: str, amount: int, currency: str, card: str
    ) -> Charge:
        from sqlalchemy import text  # noqa: PLC0415

        answer = _provider_answer(psp_key, card)
        params = {
            "key": psp_key,
            "reference": reference,
            "amount": amount,
            "currency": currency,
            "charge_id": answer.charge_id,
            "decline_code": answer.decline_code,
        }
        # The provider's own transaction, committed whatever becomes of the caller's.
        async with self.engine.begin() as conn:
            await conn.execute(text(f"INSERT INTO {self.calls} VALUES (:key)"), params)
            insert = (
                f"INSERT IGNORE INTO {self.charges}"
                if self.mariadb
                else f"INSERT INTO {self.charges}"
            ) + " VALUES (:key, :reference, :amount, :currency, :charge_id, :decline_code)"
            if not self.mariadb:
                insert += " ON CONFLICT (idempotency_key) DO NOTHING"
            await conn.execute(text(insert), params)
            first = await conn.execute(
                text(
                    f"SELECT charge_id, decline_code FROM {self.charges}"
                    " WHERE idempotency_key = :key"
                ),
                params,
            )
            charge_id, decline_code = first.one()
        return Charge(charge_id, decline_code)

    def connection(self, request: Request) -> Any:
        # The payment row rides on the transaction that carries the idempotency record.
        return idempotent_connection(request)

    async def add_payment(self, conn: Any, payment: Payment) -> None:
        from sqlalchemy import text  # noqa: PLC0415

        await conn.execute(
            text(f"INSERT INTO {self.payments} VALUES (:id, :amount, :currency, :charge_id)"),
            asdict(payment),
        )

    async def stage_event(
        self, conn: Any, attempt: Any, destination: str, event: dict[str, Any]
    ) -> OutboxMessage | None:
        # On the payment's connection and in its transaction: the event commits with the
        # payment row and the stored response, or not at all. Its label names it, so a
        # re-execution after a crash stages the same id.
        return await self.outbox.astage(conn, attempt, destination, event, label="captured")

    async def migrate(self, store: Any) -> None:
        from sqlalchemy import text  # noqa: PLC0415

        # The outbox's own DDL, on the app's engine (one transaction), like the tables above.
        name = {"sqlite": "sqlite", "mysql": "mysql"}.get(self.engine.dialect.name, "postgresql")
        async with self.engine.begin() as conn:
            for statement in self.outbox.sql(name).ddl():
                await conn.execute(text(statement))

    async def payment(self, payment_id: str) -> Payment | None:
        from sqlalchemy import text  # noqa: PLC0415

        async with self.engine.connect() as conn:
            found = await conn.execute(
                text(
                    f"SELECT id, amount, currency, charge_id FROM {self.payments}"
                    " WHERE id = :id LIMIT 1"
                ),
                {"id": payment_id},
            )
            row = found.first()
        return None if row is None else Payment(row[0], row[1], row[2], "succeeded", row[3])

    async def ledger(self) -> Ledger:
        from sqlalchemy import text  # noqa: PLC0415

        async with self.engine.connect() as conn:
            counts = await conn.execute(
                text(
                    f"SELECT (SELECT count(*) FROM {self.payments}),"
                    f" (SELECT count(*) FROM {self.charges} WHERE charge_id IS NOT NULL),"
                    f" (SELECT count(*) FROM {self.calls}),"
                    f" (SELECT count(*) FROM (SELECT reference FROM {self.charges}"
                    "   WHERE charge_id IS NOT NULL GROUP BY reference HAVING count(*) > 1) d),"
                    f" (SELECT count(*) FROM {self.outbox.table})"
                )
            )
            payments, charges, calls, doubles, events = counts.one()
        return Ledger(payments, charges, calls, doubles, events)

    def middleware_options(self) -> dict[str, Any]:
        # Leased, then transactional: the reservation commits first, so a duplicate sees
        # IN_PROGRESS at once while the provider is called; the payment row and the fenced
        # response commit together at the end.
        return {"connection": self.engine.connect, "mode": "leased"}

    async def aclose(self) -> None:
        await self.engine.dispose()


class RedisBackend:
    """Redis: the payments and the provider's data as keys in the store's own database."""

    _CHARGE = """
    redis.call('INCR', KEYS[2])
    if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 and ARGV[4] == '1' then
        redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
    end
    return redis.call('HGET', KEYS[1], ARGV[1])
    """

    def __init__(self, store_url: str, prefix: str) -> None:
        from redis.asyncio import Redis  # noqa: PLC0415 - redis extra

        parts = urlsplit(store_url)
        self.redis = Redis.from_url(urlunsplit((*parts[:3], "", "")))
        # Outside the store's ``<prefix>:`` namespace, which its purge and stats scan; one
        # hash tag, so the example's few keys share a Cluster slot and one script may touch
        # them all.
        base = f"{prefix}.demo:{{ledger}}"
        self.payments = f"{base}:payments"
        self.charges = f"{base}:psp-charges"
        self.calls = f"{base}:psp-calls"
        self.per_reference = f"{base}:psp-charges-per-reference"
        self._charge = self.redis.register_script(self._CHARGE)

    async def setup(self) -> None:
        await self.redis.ping()

    async def charge(
        self, psp_key: str, reference: str, amount: int, currency: str, card: str
    ) -> Charge:
        answer = _provider_answer(psp_key, card)
        record = json.dumps([reference, amount, currency, answer.charge_id, answer.decline_code])
        charged = "1" if answer.charge_id else "0"
        keys = [self.charges, self.calls, self.per_reference]
        first = await self._charge(keys=keys, args=[psp_key, record, reference, charged])
        _, _, _, charge_id, decline_code = json.loads(first)
        return Charge(charge_id, decline_code)

    def connection(self, request: Request) -> Any:
        return None  # Redis has no transaction to share: the write is idempotent instead

    async def add_payment(self, conn: Any, payment: Payment) -> None:
        # The id is derived from the request's key: writing it again is harmless.
        await self.redis.hset(self.payments, payment.id, json.dumps(asdict(payment)))

    async def stage_event(
        self, conn: Any, attempt: Any, destination: str, event: dict[str, Any]
    ) -> OutboxMessage | None:
        return None  # no transaction to stage in: the outbox needs a SQL store

    async def migrate(self, store: Any) -> None:
        return None

    async def payment(self, payment_id: str) -> Payment | None:
        raw = await self.redis.hget(self.payments, payment_id)
        return None if raw is None else Payment(**json.loads(raw))

    async def ledger(self) -> Ledger:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hlen(self.payments)
            pipe.hvals(self.charges)
            pipe.get(self.calls)
            pipe.hvals(self.per_reference)
            payments, charges, calls, per_reference = await pipe.execute()
        charged = sum(1 for raw in charges if json.loads(raw)[3] is not None)
        doubles = sum(1 for count in per_reference if int(count) > 1)
        return Ledger(payments, charged, int(calls or 0), doubles, 0)

    def middleware_options(self) -> dict[str, Any]:
        return {}

    async def aclose(self) -> None:
        await self.redis.aclose()


def backend_kind(store_url: str) -> str:
    """``"sql"`` or ``"redis"``: where the example keeps its data for ``store_url``.

    Raises:
        ConfigurationError: a store the example API does not run on.
    """
    scheme = urlsplit(store_url).scheme
    if scheme == "sqlite" or scheme.startswith(("postgres", "mysql", "mariadb")):
        return "sql"
    if scheme in ("redis", "rediss"):
        return "redis"
    raise ConfigurationError(
        "the example API runs on sqlite://, postgresql://, mysql:// (MariaDB) or redis://"
        f" stores, not {f'{scheme}://' if scheme else repr(store_url)}"
    )


def open_backend(store_url: str) -> Backend:
    """The backend that keeps the example's data where ``store_url`` keeps the records."""
    query = dict(parse_qsl(urlsplit(store_url).query))
    if backend_kind(store_url) == "sql":
        return SqlBackend(store_url, query.get("table", "idempo_records"))
    return RedisBackend(store_url, query.get("prefix", "idempo"))
