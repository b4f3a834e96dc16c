"""Fail fast, with a clear message, when a service the test suite needs is not answering."""

from __future__ import annotations

import os
import sys

import psycopg

POSTGRES_URL = os.environ.get(
    "IDEMPO_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


def main() -> int:
    missing = []
    try:
        with psycopg.connect(POSTGRES_URL, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        missing.append(f"PostgreSQL at {POSTGRES_URL}: {exc}".strip())
    if missing:
        print("make test needs these services, which did not answer:", file=sys.stderr)
        for line in missing:
            print(f"  - {line}", file=sys.stderr)
        print(
            "Start PostgreSQL with: pg_ctlcluster --skip-systemctl-redirect "
            "$(ls /etc/postgresql) main start",
            file=sys.stderr,
        )
        return 1
    print("services: PostgreSQL answers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
