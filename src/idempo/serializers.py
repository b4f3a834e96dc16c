"""How a function's return value becomes the stored bytes, and back.

The default is JSON. ``TypedSerializer`` round-trips dataclasses, pydantic models and any
other type pydantic can validate, so a replay returns the same type the first call returned.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from .errors import ConfigurationError

__all__ = ["JsonSerializer", "Serializer", "TypedSerializer"]


@runtime_checkable
class Serializer(Protocol):
    """**Protocol:** turns a result into bytes for the store and back again."""

    def dumps(self, value: Any) -> bytes:
        """Encode ``value``; the bytes are stored and replayed verbatim."""
        ...

    def loads(self, data: bytes) -> Any:
        """Decode what ``dumps`` produced."""
        ...


class JsonSerializer:
    """Plain JSON, UTF-8, compact. Falsy values (``0``, ``""``, ``[]``, ``None``) round-trip.

    >>> JsonSerializer().loads(JsonSerializer().dumps({"id": 1}))
    {'id': 1}
    """

    def dumps(self, value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()

    def loads(self, data: bytes) -> Any:
        return json.loads(data)


class TypedSerializer:
    """JSON through a pydantic ``TypeAdapter``: dataclasses and models come back as themselves.

    Needs pydantic (``pip install pydantic``).

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Receipt:
    ...     id: str
    >>> s = TypedSerializer(Receipt)
    >>> s.loads(s.dumps(Receipt("r1")))
    Receipt(id='r1')
    """

    def __init__(self, type_: Any) -> None:
        try:
            from pydantic import TypeAdapter  # noqa: PLC0415 - optional dependency
        except ImportError as exc:
            raise ConfigurationError(
                "TypedSerializer needs pydantic: pip install pydantic"
            ) from exc
        self._adapter: Any = TypeAdapter(type_)

    def dumps(self, value: Any) -> bytes:
        return bytes(self._adapter.dump_json(value))

    def loads(self, data: bytes) -> Any:
        return self._adapter.validate_json(data)
