"""The exceptions idempo raises. Catch `IdempotencyError` to catch them all.

    IdempotencyError                       root
    ├── ConfigurationError                 bad URL, missing extra, store lacks a capability
    │   └── TransactionOwnershipError      the guarded block committed the guard's transaction
    ├── StoreError                         the store failed; the driver's error is __cause__
    │   ├── StoreUnavailableError          cannot reach the store (connection, timeout): retry later
    │   ├── SchemaMissingError             the records table is not there: run `idempo migrate`
    │   └── CorruptRecordError             a stored record cannot be decoded: evict it
    │       └── UndecryptableRecordError   an encrypted record the key ring cannot open
    ├── InvalidKeyError (400)              key empty, too long or not printable ASCII
    │   └── MissingKeyError (400)          a key is required and the request has none
    ├── RequestTooLargeError (413)         a request body over the limit for guarded requests
    ├── InvalidPayloadError (400)          the payload cannot be fingerprinted
    ├── PrincipalRequiredError (401)       the app's principal resolver could not say who asked
    ├── ResponseTooLargeError              the result is bigger than the store may keep
    ├── UnserializableResultError          the serializer cannot store the result
    ├── FencedError                        this attempt lost its lease; its writes were refused
    ├── ReplayedFailureError               the first execution failed deterministically; replayed
    ├── PublishError (503)                 a broker did not confirm a publish; the relay retries
    └── ConflictError
        ├── RequestInProgressError (409)   another attempt holds a live lease on the key
        ├── FingerprintMismatchError (422) same key, different payload
        └── VersionConflictError (409)     a version-guarded write found another version

HTTP-facing classes carry `status_code` so adapters map them without a lookup table. Every
error rebuilds from its ``args`` (``type(exc)(*exc.args)``), as pickle, multiprocessing and
Celery's result backends rebuild an exception in another process.
"""

from __future__ import annotations

from ._core.digest import key_ref

__all__ = [
    "ConfigurationError",
    "ConflictError",
    "CorruptRecordError",
    "FencedError",
    "FingerprintMismatchError",
    "IdempotencyError",
    "InvalidKeyError",
    "InvalidPayloadError",
    "MissingKeyError",
    "PrincipalRequiredError",
    "PublishError",
    "ReplayedFailureError",
    "RequestInProgressError",
    "RequestTooLargeError",
    "ResponseTooLargeError",
    "SchemaMissingError",
    "StoreError",
    "StoreUnavailableError",
    "TransactionOwnershipError",
    "UndecryptableRecordError",
    "UnserializableResultError",
    "VersionConflictError",
]


class IdempotencyError(Exception):
    """Root of every error idempo raises.

    >>> error = FingerprintMismatchError("k-1")
    >>> type(error)(*error.args).key, str(error) == str(type(error)(*error.args))
    ('k-1', True)
    >>> error
    FingerprintMismatchError('key#7c35c5a1785d2070 was already used with a different payload')
    """

    status_code: int = 500
    _message: str | None = None

    def _say(self, message: str, *args: object) -> None:
        """For a constructor that takes other things than its message: keep them as
        ``args``, so the error rebuilds from them, and say ``message``."""
        super().__init__(*args)
        self._message = message

    def __str__(self) -> str:
        return super().__str__() if self._message is None else self._message

    def __repr__(self) -> str:
        # The message, whose keys are digests, not the arguments, which may be raw keys.
        return f"{type(self).__name__}({str(self)!r})"


class ConfigurationError(IdempotencyError):
    """idempo was set up in a way that cannot work (bad URL, missing extra, missing capability)."""


class StoreError(IdempotencyError):
    """The store failed. The driver's own exception is kept as ``__cause__``."""

    status_code = 503


class StoreUnavailableError(StoreError):
    """The store could not be reached. Nothing was executed; retrying later is safe."""


class SchemaMissingError(StoreError):
    """The store answers but its records table (or token sequence) does not exist.

    Nothing was executed. Create the schema with ``idempo migrate URL`` (or ``store.migrate()``).
    """


class CorruptRecordError(StoreError):
    """A stored record exists but cannot be decoded (written by something else, or damaged).

    Nothing was executed and nothing is replayed. Every retry gets this error until the record
    is evicted: ``idempo evict URL KEY --operation OP --principal P`` or ``store.evict(scope)``.
    """


class UndecryptableRecordError(CorruptRecordError):
    """A stored record (its response, or its recovery point) is encrypted and the guard's
    `idempo.encryption.KeyRing` cannot open it: its key id is not in the ring (a key removed
    while records it sealed were still kept, or a guard given no ring at all), its bytes were
    altered or copied from another scope, or the ring refuses a record stored in plaintext.

    As for any corrupt record, nothing was executed and nothing is replayed, on every retry:
    put the missing key back in the ring (or evict the record).

    Attributes:
        key_id: the id of the key the record was sealed with, when its header could be read.
    """

    def __init__(self, message: str, *, key_id: str | None = None) -> None:
        super().__init__(message)
        self.key_id = key_id


class InvalidKeyError(IdempotencyError):
    """The idempotency key is empty, longer than 255 characters or not printable ASCII."""

    status_code = 400


class MissingKeyError(InvalidKeyError):
    """The endpoint requires an ``Idempotency-Key`` header (or the one the middleware was
    told to read, ``header``) and the request has none."""

    status_code = 400

    def __init__(self, message: str = "", header: str = "Idempotency-Key") -> None:
        message = message or f"the {header} header is missing"
        self._say(message, message, header)
        self.header = header


class RequestTooLargeError(IdempotencyError):
    """The request body is larger than the middleware may buffer to fingerprint it."""

    status_code = 413

    def __init__(self, limit: int) -> None:
        self._say(f"the request body is over the {limit}-byte limit for guarded requests", limit)
        self.limit = limit


class InvalidPayloadError(IdempotencyError):
    """The payload cannot be fingerprinted: it is neither bytes nor JSON-representable data."""

    status_code = 400


class ResponseTooLargeError(IdempotencyError):
    """The result to store exceeds the configured maximum; it is refused, never truncated."""

    status_code = 500

    def __init__(self, size: int, limit: int) -> None:
        message = f"the result is {size} bytes, over the {limit}-byte limit for storage"
        self._say(message, size, limit)
        self.size = size
        self.limit = limit


class FencedError(IdempotencyError):
    """The attempt's fencing token is stale: its lease expired and another attempt took over.

    The stale attempt's completion was refused and, in transactional mode, its whole
    transaction rolled back.
    """

    status_code = 409


class ReplayedFailureError(IdempotencyError):
    """The first execution failed deterministically; the stored failure is replayed as this.

    Attributes:
        error_type: qualified name of the exception the first execution raised.
        detail: its message.
    """

    status_code = 500

    def __init__(self, error_type: str, detail: str) -> None:
        message = f"{error_type}: {detail} (replayed from the first execution)"
        self._say(message, error_type, detail)
        self.error_type = error_type
        self.detail = detail


class ConflictError(IdempotencyError):
    """The key cannot be used for this call right now, or ever with this payload."""

    status_code = 409


class RequestInProgressError(ConflictError):
    """Another attempt holds a live lease on the key; retry after ``retry_after`` seconds."""

    status_code = 409

    def __init__(self, key: str, retry_after: float) -> None:
        message = f"{key_ref(key)} is in progress; retry after {retry_after:.1f}s"
        self._say(message, key, retry_after)
        self.key = key
        self.retry_after = retry_after


class FingerprintMismatchError(ConflictError):
    """The key was first used with another payload: a client bug, never replayed or executed."""

    status_code = 422

    def __init__(self, key: str) -> None:
        self._say(f"{key_ref(key)} was already used with a different payload", key)
        self.key = key


class PrincipalRequiredError(IdempotencyError):
    """The app's principal resolver returned None (it could not say who asked) and the
    middleware does not allow anonymous callers: the request is refused, never run under a
    principal shared with other callers."""

    status_code = 401


class UnserializableResultError(IdempotencyError):
    """The policy's serializer cannot turn the result into stored bytes; its own error is
    ``__cause__``. In transactional mode the work's writes roll back and the key is released;
    elsewhere the work already took effect, so the failure is recorded and replayed."""

    status_code = 500


class TransactionOwnershipError(ConfigurationError):
    """The guarded block committed (or rolled back) the transaction the guard owns on the app's
    connection. What it committed stays committed, and the key is recorded FAILED so that no
    retry runs the work again. Leave commit and rollback to the guard; use a savepoint (a
    nested transaction) to undo part of the work."""


class VersionConflictError(ConflictError):
    """A version-guarded update (`idempo.writes.update_if_version`) matched no row: the row's
    version is not the one the caller read (someone else wrote first), or the row is gone.
    Nothing was changed. Read the row again and retry in a new transaction.

    Attributes:
        table: the table written to.
        key: the key columns and values that name the row.
        expected: the version the caller expected.
        actual: the version the row holds (the latest committed), or None: no such row.
    """

    status_code = 409

    def __init__(self, table: str, key: dict[str, object], expected: int, actual: object) -> None:
        found = "no such row" if actual is None else f"version {actual!r}"
        message = f"{table} {key!r}: expected version {expected!r}, found {found}"
        self._say(message, table, key, expected, actual)
        self.table = table
        self.key = key
        self.expected = expected
        self.actual = actual


class PublishError(IdempotencyError):
    """A message could not be published, or the broker did not confirm it (unreachable,
    refused, nacked, unroutable, timed out). The broker's own error is ``__cause__``. Nothing
    is marked sent: the outbox relay retries it later."""

    status_code = 503
