"""Keys and the scope they live in."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidKeyError

MAX_KEY_LENGTH = 255


def validate_key(key: object) -> str:
    """Return ``key`` if it is 1-255 printable ASCII characters (0x21-0x7E), else raise.

    >>> validate_key("order-42")
    'order-42'
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"an idempotency key must be a string, not {type(key).__name__}")
    if not key:
        raise InvalidKeyError("the idempotency key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(f"the idempotency key is {len(key)} characters; the limit is 255")
    if not (key.isascii() and key.isprintable()) or " " in key:
        raise InvalidKeyError("the idempotency key must be printable ASCII without spaces")
    return key


@dataclass(frozen=True, slots=True)
class Scope:
    """Where a key is unique: the same key from another principal or operation never collides.

    ``principal`` is who asked (``""`` for anonymous), ``operation`` what was asked.
    """

    principal: str
    operation: str
    key: str

    @classmethod
    def of(cls, key: str, *, operation: str, principal: str = "") -> Scope:
        """Build a scope, validating the key."""
        return cls(principal=principal, operation=operation, key=validate_key(key))
