"""How a function's return value becomes the stored bytes, and back.

The default is JSON. ``TypedSerializer`` round-trips dataclasses, pydantic models and any
other type pydantic can validate, so a replay returns the same type the first call returned.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ._core.jsondecode import loads as _json_loads
from .errors import ConfigurationError

__all__ = ["JsonSerializer", "Serializer", "TypedSerializer", "return_serializer"]


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
        return _json_loads(data)


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


def return_serializer(fn: Callable[..., Any]) -> Serializer | None:
    """A `TypedSerializer` for what ``fn`` returns, when its return annotation says more than
    "JSON": dataclasses, pydantic models and containers of them then come back as what the
    function returned. None where plain JSON does (no annotation, ``dict``, ``int``...), or
    where pydantic is missing or cannot describe the type.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Receipt:
    ...     id: str
    >>> def pay() -> Receipt: ...
    >>> def count() -> int: ...
    >>> type(return_serializer(pay)).__name__, return_serializer(count)
    ('TypedSerializer', None)
    """
    try:
        hint = typing.get_type_hints(fn).get("return")
    except (NameError, TypeError):
        return None
    if hint in (None, type(None), object, Any) or hint in _PLAIN_JSON:
        return None
    try:
        return TypedSerializer(hint)
    except Exception:  # noqa: BLE001 - no pydantic, or a type it cannot describe: plain JSON
        return None


_PLAIN_JSON = (str, int, float, bool, dict, list)
