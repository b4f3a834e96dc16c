"""A response as idempo keeps it: what may be stored and replayed, and its stored form."""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import chain

from .. import _wire
from .._core.jsondecode import loads as json_loads
from ..errors import CorruptRecordError
from .fingerprint import _ascii_string
from .keys import Header

REPLAYED_HEADER = _wire.REPLAYED_HEADER.lower().encode()

# RFC 9110 §7.6.1 hop-by-hop fields, plus the obsolete ones proxies still send. A replay
# travels over a new connection, so the first connection's fields mean nothing there.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# A session cookie set for the first caller must not be handed to whoever replays, nor kept
# in the store at all.
_PRIVATE = frozenset({b"set-cookie"})
_NOT_SHAREABLE = _HOP_BY_HOP | _PRIVATE
_NOT_REPLAYED = _NOT_SHAREABLE | {REPLAYED_HEADER}

_STORED_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True, init=False)
class HttpResponse:
    """A whole response: status, headers as sent, body bytes."""

    status: int
    headers: tuple[Header, ...] = ()
    body: bytes = b""

    def __init__(self, status: int, headers: tuple[Header, ...] = (), body: bytes = b"") -> None:
        # The generated __init__ of a frozen dataclass sets each field through
        # object.__setattr__, which costs about twice what setting it through its slot
        # does; every request makes one or two of these (a replay, a captured response).
        _set_status(self, status)
        _set_headers(self, headers)
        _set_body(self, body)

    def shareable(self) -> HttpResponse:
        """This response without hop-by-hop fields and ``Set-Cookie``: what may be stored and
        replayed to a later request."""
        kept = _kept(self.headers, _NOT_SHAREABLE)
        if len(kept) == len(self.headers):
            return self  # immutable: nothing to drop, nothing to copy
        return HttpResponse(self.status, kept, self.body)

    def replay(self, *, status_200: bool = False) -> HttpResponse:
        """The answer to a duplicate: this response, shareable, plus ``Idempotent-Replayed``.

        Args:
            status_200: answer 200 instead of a stored 2xx status (the body stays the same).
        """
        return _replayed(self.status, self.headers, self.body, status_200)


def _replayed(
    status: int, headers: tuple[Header, ...], body: bytes, status_200: bool
) -> HttpResponse:
    """`HttpResponse.replay` of a response given in parts."""
    if status_200 and 200 <= status < 300:
        status = 200
    return HttpResponse(status, (*_kept(headers, _NOT_REPLAYED), _REPLAYED), body)


_REPLAYED = (REPLAYED_HEADER, b"true")

# The fields' slots (what the frozen instance's own __setattr__ refuses to set).
_set_status = HttpResponse.__dict__["status"].__set__
_set_headers = HttpResponse.__dict__["headers"].__set__
_set_body = HttpResponse.__dict__["body"].__set__


def _kept(headers: tuple[Header, ...], dropped: frozenset[bytes]) -> tuple[Header, ...]:
    """``headers`` without the fields named in ``dropped`` (which names ``Connection``, as
    both sets above do) or in a ``Connection`` field."""
    try:
        # The usual case, nothing to drop, found in one pass in C.
        if dropped.isdisjoint(map(bytes.lower, dict(headers))):
            return headers
    except (TypeError, ValueError):
        pass  # names that are not bytes (an app's redactor made them): the pass below
    names = [name.lower() for name, _ in headers]
    if b"connection" in names:
        dropped = dropped | {
            token.strip().lower()
            for name, (_, value) in zip(names, headers, strict=True)
            if name == b"connection"
            for token in value.split(b",")
        }
    return tuple(item for name, item in zip(names, headers, strict=True) if name not in dropped)


@dataclass(frozen=True, slots=True)
class UnkeptResponse:
    """A response that was sent to the client but was too large to store."""

    status: int
    size: int
    limit: int


def encode_response(response: HttpResponse) -> bytes:
    """The stored form: one line of JSON (format version, status, headers), then the body.

    Header bytes travel as Latin-1 text, which maps every byte to one character and back,
    so a replay is byte-identical; the body follows the newline untouched.
    """
    # Written out rather than through json.dumps (which builds an encoder per call): the
    # same bytes, as the format's test checks. ASCII escapes keep the line free of raw
    # newlines whatever the headers hold.
    headers = response.headers
    if not b"".join(chain.from_iterable(headers)).translate(None, _PLAIN_BYTES):
        # Header bytes that are all printable ASCII but quotes and backslashes (what servers
        # send): each one's JSON string is its own text between quotes.
        listed = b'["%s"]' % b'"],["'.join(map(b'","'.join, headers)) if headers else b""
        return b"%s%d,%s%s]}\n%s" % (_HEAD, response.status, _HEADERS, listed, response.body)
    fields = ",".join(
        [
            f"[{_ascii_string(name.decode('latin-1'))},{_ascii_string(value.decode('latin-1'))}]"
            for name, value in headers
        ]
    )
    head = f'{{"v":{_STORED_FORMAT_VERSION},"status":{int(response.status)},"headers":[{fields}]}}'
    return head.encode() + b"\n" + response.body


# The stored line's fixed text before the status and before the headers; the bytes a
# header's JSON string holds as they are (`_PLAIN_TEXT`, for the deletion test above).
_HEAD = b'{"v":%d,"status":' % _STORED_FORMAT_VERSION
_HEADERS = b'"headers":['
_PLAIN_BYTES = bytes(range(0x20, 0x7F)).translate(None, b'"\\')


# A JSON string's text that is printable ASCII with nothing escaped (no quote, no backslash):
# it decodes to its own characters, so its bytes are the header bytes it stands for.
_PLAIN_TEXT = rb"[ !#-\[\]-~]*"
_PLAIN_HEADER = rb'\["%s","%s"\]' % (_PLAIN_TEXT, _PLAIN_TEXT)
_plain_head = re.compile(
    rb'\{"v":%d,"status":([1-9][0-9]{2}),"headers":\[((?:%s(?:,%s)*)?)\]\}'
    % (_STORED_FORMAT_VERSION, _PLAIN_HEADER, _PLAIN_HEADER)
).fullmatch
_plain_headers = re.compile(rb'\["(%s)","(%s)"\]' % (_PLAIN_TEXT, _PLAIN_TEXT)).findall

# A replay's usual line, read by one match: up to `_REPLAYABLE_PAIRS` headers, each a
# lowercase name that a replay keeps (none of `_NOT_REPLAYED`, so no Connection field that
# could name others) and a plain value. Its groups are the status, then each name and value
# in order (None past the last); any other line takes `_plain_head` or the parser, and
# `_kept`.
_REPLAYABLE_PAIRS = 8
_DROPPED = b"|".join(sorted(map(re.escape, _NOT_REPLAYED)))  # `_NOT_REPLAYED`, as a regex
_REPLAYABLE_HEADER = rb'\["(?!(?:%s)")([ !#-@\[\]-~]*)","(%s)"\]' % (_DROPPED, _PLAIN_TEXT)
_more = b""
for _ in range(_REPLAYABLE_PAIRS - 1):
    _more = rb"(?:,%s%s)?" % (_REPLAYABLE_HEADER, _more)
_replayable_head = re.compile(
    rb'\{"v":%d,"status":([1-9][0-9]{2}),"headers":\[(?:%s%s)?\]\}'
    % (_STORED_FORMAT_VERSION, _REPLAYABLE_HEADER, _more)
).fullmatch


def decode_response(data: bytes) -> HttpResponse:
    """The response `encode_response` stored.

    Raises:
        CorruptRecordError: ``data`` is not a stored response of this format.
    """
    return decoded(data, None)


def decoded(data: bytes, replay_200: bool | None) -> HttpResponse:
    """`decode_response` of ``data`` (``replay_200`` None), or its `HttpResponse.replay`
    with ``status_200=replay_200``, made at once: a replay never needs the stored response
    itself, and making it would cost about as much again."""
    head_line, newline, body = data.partition(b"\n")
    if replay_200 is not None and newline:
        found = _replayable_head(head_line)
        if found is not None:
            fields = found.groups()
            status = int(fields[0])
            if replay_200 and 200 <= status < 300:
                status = 200
            pairs = iter(fields[1 : fields.index(None)] if fields[-1] is None else fields[1:])
            return HttpResponse(status, (*zip(pairs, pairs, strict=True), _REPLAYED), body)
    plain = _plain_head(head_line)
    if plain is not None and newline:
        # The line as `encode_response` writes it for a response whose header bytes are
        # printable ASCII without quotes or backslashes: each string's bytes are its text,
        # so they are taken as they are, without parsing JSON or encoding strings.
        status, headers = int(plain[1]), tuple(_plain_headers(plain[2]))
    else:
        stored = _parsed(head_line, newline, body)
        if replay_200 is None:
            return stored
        status, headers = stored.status, stored.headers
    if replay_200 is None:
        return HttpResponse(status, headers, body)
    return _replayed(status, headers, body, replay_200)


def _parsed(head_line: bytes, newline: bytes, body: bytes) -> HttpResponse:
    """`decode_response` of any stored response: its line parsed as JSON."""
    try:
        head = json_loads(head_line)
        if not newline or head.get("v") != _STORED_FORMAT_VERSION:
            raise ValueError(f"stored response format {head.get('v')!r}")
        headers = tuple(
            [(name.encode("latin-1"), value.encode("latin-1")) for name, value in head["headers"]]
        )
        status = int(head["status"])
        if not 100 <= status <= 999:  # what an HTTP status line can carry
            raise ValueError(f"status {status}")
        return HttpResponse(status, headers, body)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CorruptRecordError(f"the stored response cannot be read: {exc}") from exc
