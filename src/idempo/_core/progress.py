"""What a record's recovery point holds: the steps the work committed, and their small state.

A store keeps the point as text and never reads it. It is JSON, ``{"steps": [...], "state":
{...}}``; any other text (a point written by hand or by another program) is read as the name
of one committed step with no state, which is what SPEC §5 calls a recovery point.

>>> progress = Progress.decode(None).after("reserve-stock", {"hold": 42})
>>> progress.encode()
'{"steps":["reserve-stock"],"state":{"hold":42}}'
>>> Progress.decode(progress.encode()).last, Progress.decode("charged").steps
('reserve-stock', ('charged',))
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..errors import ConfigurationError, UnserializableResultError

# A point travels with every takeover and checkpoint, and Redis keeps it in the record's hash:
# it is for step names and ids, not for results (those are what the work returns).
MAX_POINT_BYTES = 16 * 1024
MAX_STEP_LENGTH = 100


@dataclass(frozen=True, slots=True)
class Progress:
    """The committed steps, oldest first, and the state recorded with them (merged).
    ``resumed``: the steps began in an earlier attempt, taken over."""

    steps: tuple[str, ...] = ()
    state: Mapping[str, Any] = field(default_factory=dict)
    resumed: bool = False

    @property
    def last(self) -> str | None:
        return self.steps[-1] if self.steps else None

    @classmethod
    def decode(cls, point: str | None) -> Progress:
        if point is None:
            return NO_PROGRESS
        try:
            data = json.loads(point)
        except ValueError:
            data = None
        steps = data.get("steps") if isinstance(data, dict) else None
        if not (isinstance(steps, list) and all(isinstance(s, str) for s in steps)):
            return cls((point,), {}, True)
        state = data.get("state", {})  # a dict, per steps
        return cls(tuple(steps), state if isinstance(state, dict) else {}, True)

    def after(self, step: str, state: Mapping[str, Any] | None = None) -> Progress:
        """This progress with ``step`` committed and ``state`` merged into what was recorded.
        Recording a step again keeps its place and merges its state."""
        if not isinstance(step, str) or not step or len(step) > MAX_STEP_LENGTH:
            raise ConfigurationError(
                f"a step name must be a non-empty string of at most {MAX_STEP_LENGTH}"
                f" characters, not {step!r}"
            )
        steps = self.steps if step in self.steps else (*self.steps, step)
        return Progress(steps, {**self.state, **(state or {})}, self.resumed)

    def encode(self) -> str:
        """The point as the store keeps it; `UnserializableResultError` when the state is not
        JSON or the point would pass `MAX_POINT_BYTES`."""
        try:
            text = json.dumps(
                {"steps": list(self.steps), "state": dict(self.state)},
                separators=(",", ":"),
                ensure_ascii=False,
                allow_nan=False,
            )
        except (TypeError, ValueError) as exc:
            raise UnserializableResultError(
                f"the state of step {self.last!r} cannot be recorded as JSON: {exc}"
            ) from exc
        size = len(text.encode())
        if size > MAX_POINT_BYTES:
            raise UnserializableResultError(
                f"the recovery point after step {self.last!r} is {size} bytes; the limit is"
                f" {MAX_POINT_BYTES}: record ids and names, and return results instead"
            )
        return text


# What a fresh attempt starts with: one shared value, since nearly every call has no steps
# and an object per call costs the hot path (and the garbage collector) for nothing.
NO_PROGRESS = Progress((), MappingProxyType({}))
