"""The one guard for optional dependencies: an import that fails names the extra to install.

    with optional_import("the PostgreSQL store needs psycopg", extra="postgres"):
        import psycopg

Without psycopg this raises ``ConfigurationError("the PostgreSQL store needs psycopg: pip
install 'idempo[postgres]'")`` with the ImportError as its cause, so a user who opened a
store or imported an adapter learns the one command that fixes it, not a bare module name.
"""

from __future__ import annotations

from types import TracebackType

from .errors import ConfigurationError

__all__ = ["optional_import"]


class optional_import:  # lower case: used as a statement, like contextlib.suppress
    """A block of imports whose ImportError becomes a `ConfigurationError` naming ``extra``.

    >>> with optional_import("the demo needs a module", extra="demo"):
    ...     import idempo_no_such_module
    Traceback (most recent call last):
    ...
    idempo.errors.ConfigurationError: the demo needs a module: pip install 'idempo[demo]'
    """

    __slots__ = ("extra", "what")

    def __init__(self, what: str, *, extra: str | None) -> None:
        self.what = what
        self.extra = extra

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Returns None: any other exception, and every ImportError, goes on (converted).
        if isinstance(error, ImportError):
            hint = f": pip install 'idempo[{self.extra}]'" if self.extra else ""
            raise ConfigurationError(f"{self.what}{hint}") from error
