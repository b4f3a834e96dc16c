"""idempo: make retries safe.

A caller that timed out retries with the same idempotency key; idempo runs the work once and
answers every retry with the first result.

    from idempo import Idempotency, open_store

    idem = Idempotency(open_store("sqlite:///app.db"))

    @idem.idempotent(key="order_id")
    def charge(order_id: str, amount: int) -> dict[str, str]: ...
"""

from __future__ import annotations

from ._core.fingerprint import fingerprint
from ._core.flow import Codec
from ._core.keys import Scope, derive_key, step_key, validate_key
from ._core.record import Record, Status
from ._reexport import publish
from .errors import (
    ConfigurationError,
    ConflictError,
    CorruptRecordError,
    FencedError,
    FingerprintMismatchError,
    IdempotencyError,
    InvalidKeyError,
    InvalidPayloadError,
    MissingKeyError,
    PrincipalRequiredError,
    PublishError,
    ReplayedFailureError,
    RequestInProgressError,
    RequestTooLargeError,
    ResponseTooLargeError,
    SchemaMissingError,
    StoreError,
    StoreUnavailableError,
    TransactionOwnershipError,
    UndecryptableRecordError,
    UnserializableResultError,
    VersionConflictError,
)
from .guard import AsyncAttempt, AsyncHandle, AsyncIdempotency, Attempt, Handle, Idempotency
from .policy import Policy
from .serializers import JsonSerializer, Serializer, TypedSerializer
from .stores import AsyncStore, Store, open_async_store, open_store

__version__ = "0.1.0"

__all__ = [
    "AsyncAttempt",
    "AsyncHandle",
    "AsyncIdempotency",
    "AsyncStore",
    "Attempt",
    "Codec",
    "ConfigurationError",
    "ConflictError",
    "CorruptRecordError",
    "FencedError",
    "FingerprintMismatchError",
    "Handle",
    "Idempotency",
    "IdempotencyError",
    "InvalidKeyError",
    "InvalidPayloadError",
    "JsonSerializer",
    "MissingKeyError",
    "Policy",
    "PrincipalRequiredError",
    "PublishError",
    "Record",
    "ReplayedFailureError",
    "RequestInProgressError",
    "RequestTooLargeError",
    "ResponseTooLargeError",
    "SchemaMissingError",
    "Scope",
    "Serializer",
    "Status",
    "Store",
    "StoreError",
    "StoreUnavailableError",
    "TransactionOwnershipError",
    "TypedSerializer",
    "UndecryptableRecordError",
    "UnserializableResultError",
    "VersionConflictError",
    "derive_key",
    "fingerprint",
    "open_async_store",
    "open_store",
    "step_key",
    "validate_key",
]

# Defined in the private layers, imported from here.
publish(
    __name__,
    Codec,
    Record,
    Scope,
    Status,
    derive_key,
    fingerprint,
    step_key,
    validate_key,
)
del publish
