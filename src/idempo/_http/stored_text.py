"""What of a request may go into a store's key columns as it is (SPEC §8).

The raw path of a request no route template names, and the principal, come from outside the
app's code: a ``%00`` in a path, or a few KB of it, would reach the store's primary key
(PostgreSQL's text refuses NUL; its index refuses a row over 2704 bytes) and turn a hostile
request into a 5xx. `stored_text` keeps short printable ASCII as it is and replaces anything
else with its SHA-256, which every store takes.

    >>> stored_text("/payments/7")
    '/payments/7'
    >>> stored_text("/no\\x00such")[:7], len(stored_text("/" + "x" * 3000))
    ('sha256:', 71)
"""

from __future__ import annotations

import hashlib

__all__ = ["MAX_STORED_TEXT", "stored_text"]

MAX_STORED_TEXT = 256
"""The longest path or principal kept as it is (with the 255-character key, far under the
smallest primary-key limit of the SQL stores)."""


def stored_text(text: str) -> str:
    """``text`` if it is at most `MAX_STORED_TEXT` printable ASCII characters (0x20-0x7E),
    else ``sha256:`` and the hex SHA-256 of its UTF-8: the same text always maps to the
    same value, and no value carries a NUL or an unbounded length into a store.

    >>> stored_text("user:42"), stored_text("user:jos\\u00e9")[:15]
    ('user:42', 'sha256:ed76f8c8')
    """
    if len(text) <= MAX_STORED_TEXT and text.isascii() and text.isprintable():
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return f"sha256:{digest}"
