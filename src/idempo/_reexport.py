"""Re-exported names report the public module users import them from.

The layers live in private modules (``idempo._core``, ``idempo._http``); a name they define
and a public module exports should say ``idempo.Scope``, not ``idempo._core.keys.Scope``, in
reprs, pickles, ``help()`` and generated docs.
"""

from __future__ import annotations

import typing
from typing import Any


def publish(module: str, *objects: Any) -> None:
    """Make each of ``objects`` report ``module`` as its ``__module__``.

    A class's own annotations are resolved first, in the module that defined it:
    ``typing.get_type_hints`` looks names up in ``__module__``'s globals, where the defining
    module's imports (``datetime``...) are not.

    >>> class Point:
    ...     x: int
    >>> publish("idempo", Point)
    >>> Point.__module__, typing.get_type_hints(Point)
    ('idempo', {'x': <class 'int'>})
    """
    for obj in objects:
        own = vars(obj).get("__annotations__") if isinstance(obj, type) else None
        if own:
            hints = typing.get_type_hints(obj, include_extras=True)
            obj.__annotations__ = {name: hints[name] for name in own}
        obj.__module__ = module
