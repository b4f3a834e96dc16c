"""The public namespace is curated and sorted."""

from __future__ import annotations

import pickle
import re
import typing
from datetime import datetime
from pathlib import Path
from types import ModuleType

import idempo
import idempo.asgi
import idempo.consumer
import idempo.guard
import idempo.http
import idempo.saga
import idempo.serializers
import idempo.wsgi


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


def test_exported_names_report_the_public_module_they_are_imported_from() -> None:
    """Names defined in the private layers say ``idempo.X`` in reprs, pickles and help()."""
    modules = (
        idempo,
        idempo.guard,
        idempo.consumer,
        idempo.saga,
        idempo.serializers,
        idempo.http,
        idempo.asgi,
        idempo.wsgi,
    )
    for module in modules:
        for name in module.__all__:
            # Constants (ints, bytes) have no module of their own.
            defined_in = getattr(getattr(module, name), "__module__", None) or module.__name__
            assert not any(part.startswith("_") for part in defined_in.split(".")), (
                name,
                defined_in,
            )


def test_a_republished_class_keeps_its_type_hints() -> None:
    """Its annotations name things of its defining module (``datetime``), not of idempo's."""
    hints = typing.get_type_hints(idempo.Record)
    assert hints["created_at"] is datetime
    assert pickle.loads(pickle.dumps(idempo.Status.COMPLETED)) is idempo.Status.COMPLETED


def test_integrations_use_the_guard_through_public_names_only() -> None:
    """The consumers and the saga are written on the two-phase handle: no dunder calls of the
    guard's context managers, no private names of idempo.guard."""
    src = Path(idempo.__file__).parent
    integrations = ("contrib/aio_pika.py", "contrib/faststream.py", "contrib/celery.py")
    for path in ("consumer.py", "saga.py", *integrations):
        text = (src / path).read_text()
        assert not re.search(r"\.__a?(enter|exit)__\(", text), path
        assert not re.search(r"guard import[^\n]*\b_[a-zA-Z]", text), path
        assert "._binds" not in text, path
