"""The host's clock, for the stores that have no clock of their own (SQLite, memory) and
for the cache tier: one function, so a test can move it and show who reads it.

PostgreSQL and MariaDB never read it: with ``now=None`` their statements read the server's
clock (SPEC §2 rule 9).
"""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["host_now"]


def host_now() -> datetime:
    """This host's time, aware UTC."""
    return datetime.now(UTC)
