"""idempo's refusals as RFC 9457 problem responses."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from .._wire import PROBLEM_MEDIA_TYPE, PROBLEM_TYPE_BASE
from ..errors import (
    CorruptRecordError,
    FencedError,
    FingerprintMismatchError,
    IdempotencyError,
    InvalidKeyError,
    InvalidPayloadError,
    MissingKeyError,
    PrincipalRequiredError,
    RequestInProgressError,
    RequestTooLargeError,
    SchemaMissingError,
    StoreError,
    UndecryptableRecordError,
)
from .keys import Header
from .response import HttpResponse

_MEDIA_TYPE = PROBLEM_MEDIA_TYPE.encode()


def problem(
    status: int,
    kind: str,
    title: str,
    detail: str,
    *,
    headers: Sequence[Header] = (),
) -> HttpResponse:
    """An ``application/problem+json`` response whose ``type`` is ``urn:idempo:problem:kind``.

    >>> problem(400, "missing-key", "Missing idempotency key", "Send one.").body[:38]
    b'{"type":"urn:idempo:problem:missing-ke'
    """
    body = json.dumps(
        {"type": PROBLEM_TYPE_BASE + kind, "title": title, "status": status, "detail": detail},
        separators=(",", ":"),
    ).encode()
    return HttpResponse(
        status,
        (
            (b"content-type", _MEDIA_TYPE),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ),
        body,
    )


def _retry_after(seconds: float) -> Header:
    # Retry-After is a whole number of seconds (RFC 9110 §10.2.3); 0 would invite a storm.
    return (b"retry-after", str(max(1, math.ceil(seconds))).encode())


def problem_for(
    exc: IdempotencyError,
    *,
    max_retry_after: int = 5,
    store_retry_after: int = 5,
    in_progress_status: int = 409,
    mismatch_status: int = 422,
) -> HttpResponse:
    """The problem response for one of idempo's refusals.

    Args:
        exc: what the guard (or the adapter) raised before any work ran.
        max_retry_after: the most a 409's ``Retry-After`` says, though the lease may end
            later: the first request is usually done long before its lease ends, and asking
            again costs one index lookup.
        store_retry_after: ``Retry-After`` for a 503 when the store is unreachable.
        in_progress_status: 409 (default) or 202 for a request still in progress (SPEC §4's
            two conventions).
        mismatch_status: 422 (default) or 409 for a key reused with another request.

    >>> problem_for(RequestInProgressError("k", retry_after=2), in_progress_status=202).status
    202
    """
    match exc:
        case MissingKeyError(header=header):
            return problem(
                400,
                "missing-key",
                "Missing idempotency key",
                f"This endpoint requires an {header} header: one unique value per "
                "intent, reused on every retry.",
            )
        case InvalidKeyError():
            return problem(400, "invalid-key", "Malformed idempotency key", str(exc))
        case InvalidPayloadError():
            return problem(400, "invalid-request", "Request cannot be fingerprinted", str(exc))
        case RequestTooLargeError():
            return problem(413, "request-too-large", "Request body too large", str(exc))
        case FingerprintMismatchError():
            return problem(
                mismatch_status,
                "fingerprint-mismatch",
                "Idempotency key reused with a different request",
                "This Idempotency-Key was already used with a different request (method, "
                "path, query or body). Use a new key for a new intent.",
            )
        case RequestInProgressError(retry_after=retry_after):
            return problem(
                in_progress_status,
                "request-in-progress",
                "Request in progress",
                "A request with this Idempotency-Key is still being processed. Retry later "
                "to receive its response.",
                headers=[_retry_after(min(retry_after, max_retry_after))],
            )
        case PrincipalRequiredError():
            return problem(
                401,
                "principal-required",
                "Caller not identified",
                "This endpoint could not tell who sent the request, so it cannot keep its "
                "Idempotency-Key apart from other callers' keys. Authenticate, then retry.",
            )
        case FencedError():
            return problem(
                409,
                "lease-lost",
                "Request taken over",
                "This request ran past its lease and another attempt with the same "
                "Idempotency-Key took over; its answer was not stored. Retry with the same "
                "key to receive the answer of the attempt that holds it.",
                headers=[_retry_after(max_retry_after)],
            )
        case UndecryptableRecordError():
            return problem(
                503,
                "corrupt-record",
                "Stored idempotency record unreadable",
                "The request was not processed: the record stored for this Idempotency-Key "
                "is encrypted and this server's key ring cannot open it, and every retry gets "
                "this answer until an operator restores its key or evicts it (idempo evict; "
                "the server's log names the record and the key id).",
                headers=[_retry_after(store_retry_after)],
            )
        case CorruptRecordError():
            return problem(
                503,
                "corrupt-record",
                "Stored idempotency record unreadable",
                "The request was not processed: the record stored for this Idempotency-Key "
                "cannot be decoded, and every retry gets this answer until an operator "
                "evicts it (idempo evict; the server's log names the record).",
                headers=[_retry_after(store_retry_after)],
            )
        case SchemaMissingError():
            return problem(
                503,
                "schema-missing",
                "Idempotency store not set up",
                "The request was not processed: the idempotency store has no records table "
                "yet. An operator must run `idempo migrate` (the server's log names the "
                "store); retry with the same key afterwards.",
                headers=[_retry_after(store_retry_after)],
            )
        case StoreError():
            return problem(
                503,
                "store-unavailable",
                "Idempotency store unavailable",
                "The request was not processed: the idempotency store cannot be reached. "
                "Retry with the same key later.",
                headers=[_retry_after(store_retry_after)],
            )
    return problem(500, "internal", "Idempotency error", str(exc))
