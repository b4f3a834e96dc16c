"""How a key is named where it must not be shown: log lines, events, error messages.

No imports from the rest of idempo, so that `idempo.errors` can use it too.
"""

from __future__ import annotations

import hashlib

__all__ = ["key_digest", "key_ref"]


def key_digest(key: str) -> str:
    """The digest that stands for a key in events, log lines and error messages: the first
    16 hex digits of its SHA-256. The app (or an operator holding the key) computes the same
    to find the record (``idempo list`` shows it); the log does not hand the key out.

    >>> key_digest("order-42")
    '3bf8b157c4238eef'
    """
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def key_ref(key: str) -> str:
    """How an error message names ``key``: by its digest, never the key itself. The
    exception's attributes (``.key``, ``.scope``) still hold the key for the app.

    >>> key_ref("order-42")
    'key#3bf8b157c4238eef'
    """
    return f"key#{key_digest(key)}"
