"""How the guard stores an HTTP response and replays it: the `Codec` every adapter uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._core.keys import evict_hint
from .._core.record import Record, Status
from ..encryption import refuse_sealed
from ..errors import CorruptRecordError
from .problems import problem
from .redact import with_length
from .response import HttpResponse, UnkeptResponse, decoded, encode_response

Classifier = Callable[[int], Status | None]
"""Decides what a response status means: COMPLETED or FAILED (stored and replayed), or None
(transient: the key is released and a retry executes again)."""

Redactor = Callable[[HttpResponse], HttpResponse]
"""What of a response is stored: the first caller gets the response itself, every replay
the redacted one (`idempo.http.redact_headers`, `idempo.http.redact_json`)."""

_TRANSIENT_4XX = frozenset({408, 409, 425, 429})


def classify_status(status: int) -> Status | None:
    """SPEC §2 rule 7: 2xx/3xx completed; 4xx failed (replayed) except 408, 409, 425 and
    429; 5xx (and anything else) transient.

    >>> classify_status(201), classify_status(404), classify_status(429), classify_status(503)
    (<Status.COMPLETED: 'completed'>, <Status.FAILED: 'failed'>, None, None)
    """
    if 200 <= status < 400:
        return Status.COMPLETED
    if 400 <= status < 500 and status not in _TRANSIENT_4XX:
        return Status.FAILED
    return None


@dataclass(frozen=True, slots=True)
class HttpCodec:
    """How the guard stores an HTTP response and replays it (the `Codec` for HTTP).

    The block's result is an `HttpResponse` (stored per ``classify``), an `UnkeptResponse`
    (recorded as a FAILED 500 problem if its status would have been stored, so a retry does
    not execute again), or None (the app sent no whole response: the key is released).
    Exceptions release the key. ``redact``, when given, makes what is stored of a response
    (`Redactor`); a ``Content-Length`` it leaves behind is set to the body it returns.
    With ``replays``, `decode` gives the answer to a duplicate, `HttpResponse.replay` (with
    ``status_200``), rather than the stored response: what the middlewares send as it is,
    made without the stored response in between.

    >>> from idempo.http import redact_headers
    >>> codec = HttpCodec(redact=redact_headers("x-api-key"))
    >>> codec.encode_result(HttpResponse(201, ((b"x-api-key", b"sk_live_1"),), b"{}"))[1]
    b'{"v":1,"status":201,"headers":[]}\\n{}'
    """

    classify: Classifier = field(default=classify_status)
    redact: Redactor | None = None
    replays: bool = False
    status_200: bool = False

    def encode_result(self, value: Any) -> tuple[Status | None, bytes]:
        if isinstance(value, HttpResponse):
            status = self.classify(value.status)
            if status is None:
                return None, b""
            if self.redact is None:  # the many apps that redact nothing: no call more
                return status, encode_response(value.shareable())
            return status, encode_response(_redacted(self.redact, value))
        if isinstance(value, UnkeptResponse) and self.classify(value.status) is not None:
            detail = (
                f"The request was processed and answered {value.status}, but its response "
                f"({value.size} bytes or more) was over the {value.limit}-byte limit for "
                "storage, so it cannot be replayed. Do not retry this key."
            )
            return Status.FAILED, encode_response(_not_stored(detail))
        return None, b""

    def encode_error(self, exc: BaseException) -> tuple[Status | None, bytes]:
        return None, b""

    def encode_unstorable(self, exc: Exception) -> bytes:
        detail = (
            f"The request was processed, but its response could not be stored ({exc}), "
            "so it cannot be replayed. Do not retry this key."
        )
        return encode_response(_not_stored(detail))

    def decode(self, record: Record) -> HttpResponse:
        try:
            if record.response is None:
                raise CorruptRecordError("the record holds no response to replay")
            return decoded(record.response, self.status_200 if self.replays else None)
        except CorruptRecordError as exc:
            # Sealed bytes never parse (they start with a NUL), so a guard with no key ring
            # learns why here, at no cost to the replays that do parse.
            refuse_sealed(record)
            # Nothing runs and nothing is replayed until an operator evicts the record.
            raise CorruptRecordError(f"{exc}; to evict it, {evict_hint(record.scope)}") from exc


def _not_stored(detail: str) -> HttpResponse:
    return problem(500, "response-not-stored", "Response not stored", detail)


def _redacted(redact: Redactor, response: HttpResponse) -> HttpResponse:
    """What is kept of ``response``: its shareable part, redacted."""
    redacted = redact(response.shareable())
    if not isinstance(redacted, HttpResponse):
        raise TypeError(f"redact= returned {type(redacted).__name__}, not an HttpResponse")
    return with_length(redacted)
