"""Fail fast, with a clear message, when a service the test suite needs is not answering."""

from __future__ import annotations

import os
import sys

import psycopg
import pymysql
import redis

from idempo.stores.mysql import connect_options

POSTGRES_URL = os.environ.get(
    "IDEMPO_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("IDEMPO_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
MYSQL_URL = os.environ.get("IDEMPO_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")

START = {
    "PostgreSQL": ("pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"),
    "Redis": (
        'redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" '
        "--appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log"
    ),
    "MariaDB": "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
}


def main() -> int:
    missing: dict[str, str] = {}
    try:
        with psycopg.connect(POSTGRES_URL, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        missing["PostgreSQL"] = f"PostgreSQL at {POSTGRES_URL}: {exc}".strip()
    try:
        with redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5, socket_timeout=5) as r:
            r.ping()
    except redis.RedisError as exc:
        missing["Redis"] = f"Redis at {REDIS_URL}: {exc}".strip()
    try:
        with pymysql.connect(**connect_options(MYSQL_URL), connect_timeout=5) as conn:
            conn.ping()
    except pymysql.err.Error as exc:
        missing["MariaDB"] = f"MariaDB at {MYSQL_URL}: {exc}".strip()
    if missing:
        print("make test needs these services, which did not answer:", file=sys.stderr)
        for line in missing.values():
            print(f"  - {line}", file=sys.stderr)
        for name in missing:
            print(f"Start {name} with: {START[name]}", file=sys.stderr)
        return 1
    print("services: PostgreSQL, Redis and MariaDB answer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
