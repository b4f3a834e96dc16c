"""The example payments API that ``idempo demo`` serves and storms (needs ``idempo[demo]``).

    from idempo.example import create_app
    app = create_app("sqlite:///payments.db")      # uvicorn, hypercorn, ...

or ``idempo demo --serve --store sqlite:///payments.db``. `idempo.example.app` has the
contract; docs/example-api.md walks through it.
"""

from .app import create_app

__all__ = ["create_app"]
