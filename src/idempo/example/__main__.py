"""``python -m idempo.example --store URL [--host H] [--port N] [--lease SECONDS] [--events D]``.

The process ``idempo demo`` starts, kills and restarts; ``idempo demo --serve`` is the same
server for people.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from .app import DEFAULT_LEASE, EVENTS
from .server import serve


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m idempo.example")
    parser.add_argument("--store", required=True, help="store URL; it holds the data too")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--lease", type=float, default=DEFAULT_LEASE.total_seconds())
    parser.add_argument("--events", default=EVENTS, help="where payment.captured events go")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    serve(
        args.store,
        host=args.host,
        port=args.port,
        lease=timedelta(seconds=args.lease),
        events=args.events,
        log_level=args.log_level,
    )


if __name__ == "__main__":
    main()
