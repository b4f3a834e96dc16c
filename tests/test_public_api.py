"""The public namespace is curated and sorted."""

from __future__ import annotations

from types import ModuleType

import idempo


def test_all_is_sorted_and_complete() -> None:
    """Every public name is exported through a sorted __all__, and each one resolves."""
    assert idempo.__all__ == sorted(idempo.__all__)
    for name in idempo.__all__:
        assert hasattr(idempo, name), name
    public = {
        name
        for name, value in vars(idempo).items()
        if not name.startswith("_") and not isinstance(value, ModuleType)
    }
    assert public - {"annotations"} == set(idempo.__all__)
