"""The idempotency key in a request's headers (SPEC §4: a bare token or an RFC 8941
sf-string), and the header look-ups every adapter shares."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from .. import _wire
from .._core.keys import validate_key
from .._optional import optional_import
from ..errors import InvalidKeyError

Header = tuple[bytes, bytes]
"""One header as it travels in ASGI: ``(name, value)``, both bytes, the name lowercased."""

KEY_HEADER = _wire.KEY_HEADER.lower().encode()


def header_values(headers: Iterable[Header], name: bytes) -> list[bytes]:
    """Every value of header ``name`` (lowercase), in order."""
    # lower() keeps a name's length: comparing lengths first spares lowering the others.
    size = len(name)
    return [value for key, value in headers if len(key) == size and key.lower() == name]


def headers_named(headers: Iterable[Header], names: Collection[bytes]) -> dict[bytes, list[bytes]]:
    """Every value of each header in ``names`` (lowercase), in order, found in one pass.

    >>> headers_named([(b"Content-Length", b"2"), (b"host", b"x")], {b"content-length"})
    {b'content-length': [b'2']}
    """
    found: dict[bytes, list[bytes]] = {}
    for name, value in headers:
        # Servers lowercase names as a rule (ASGI's do): a name found as it is needs no
        # lower(), and only another spelling, or a name not read at all, pays for it.
        if name not in names:
            name = name.lower()  # noqa: PLW2901 - the name as the lookups spell it
            if name not in names:
                continue
        if name in found:
            found[name].append(value)
        else:
            found[name] = [value]
    return found


def parse_key(values: Sequence[bytes]) -> str | None:
    """The idempotency key in the ``Idempotency-Key`` header values, or None when absent.

    A value is a bare token or an RFC 8941 sf-string; ``abc`` and ``"abc"`` name the same
    key. A value that starts with ``"`` but is not a valid sf-string is malformed; so is a
    header sent twice (which value would be the key?). Parameters on an sf-string are
    ignored, as RFC 8941 asks of unknown parameters.

    Raises:
        InvalidKeyError: the header is malformed or the key is not 1-255 printable ASCII.

    >>> parse_key([b'"order-42"']), parse_key([b"order-42"]), parse_key([])
    ('order-42', 'order-42', None)
    """
    if not values:
        return None
    if len(values) > 1:
        raise InvalidKeyError("the Idempotency-Key header appears more than once")
    # Optional whitespace around a field value is not part of it (RFC 9110 §5.5).
    raw = values[0].strip(b" \t")
    if raw.startswith(b'"'):
        return validate_key(_sf_string(raw))
    return validate_key(raw.decode("latin-1"))


def _sf_string(raw: bytes) -> str:
    # Imported here so that idempo itself needs http-sf only where HTTP is used.
    with optional_import("quoted Idempotency-Key values need http-sf", extra="asgi"):
        import http_sf  # noqa: PLC0415 - optional dependency (idempo[asgi])
    try:
        item = http_sf.parse(raw, tltype="item")
    except (http_sf.StructuredFieldError, ValueError) as exc:
        raise InvalidKeyError(f"the Idempotency-Key is not a valid sf-string: {exc}") from exc
    value = item[0] if isinstance(item, tuple) else item
    if not isinstance(value, str):
        raise InvalidKeyError("a quoted Idempotency-Key must be an sf-string")
    return value
