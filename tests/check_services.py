"""Fail fast, with a clear message, when a service the test suite needs is not answering."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys

import psycopg
import pymysql
import redis

from idempo.stores.mysql import connect_options

POSTGRES_URL = os.environ.get(
    "IDEMPO_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("IDEMPO_TEST_REDIS_URL", "redis://127.0.0.1:6379/1")
MYSQL_URL = os.environ.get("IDEMPO_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
RABBITMQ = ("127.0.0.1", 5672)
NATS = ("127.0.0.1", 4222)

START = {
    "PostgreSQL": ("pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"),
    "Redis": (
        'redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" '
        "--appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log"
    ),
    "MariaDB": "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
    "RabbitMQ": "rabbitmq-server -detached",
    "NATS": (
        "start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- "
        "-a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log"
    ),
    "redis-server and redis-cli": "apt-get install -y redis-server redis-tools",
}


def _greeting(address: tuple[str, int], hello: bytes = b"") -> bytes:
    """The first bytes a server sends (after ``hello``): enough to know it speaks."""
    with socket.create_connection(address, timeout=5) as sock:
        if hello:
            sock.sendall(hello)
        return sock.recv(4096)


def _rabbitmq() -> None:
    # AMQP 0-9-1: the server answers the protocol header with a Connection.Start frame.
    frame = _greeting(RABBITMQ, b"AMQP\x00\x00\x09\x01")
    if not frame.startswith(b"\x01"):
        raise OSError(f"not an AMQP 0-9-1 server (answered {frame[:8]!r})")


def _nats() -> None:
    line = _greeting(NATS).split(b"\r\n", 1)[0]
    if not line.startswith(b"INFO "):
        raise OSError(f"not a NATS server (answered {line[:20]!r})")
    if not json.loads(line[5:]).get("jetstream"):
        raise OSError("NATS answers but JetStream is off (start it with -js)")


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
    for name, probe, where in [("RabbitMQ", _rabbitmq, RABBITMQ), ("NATS", _nats, NATS)]:
        try:
            probe()
        except (OSError, ValueError) as exc:
            missing[name] = f"{name} at {where[0]}:{where[1]}: {exc}"
    tools = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    if tools:
        missing["redis-server and redis-cli"] = (
            f"{' and '.join(tools)} not on PATH (the tests start private Redis servers)"
        )
    if missing:
        print("make test needs these services, which did not answer:", file=sys.stderr)
        for line in missing.values():
            print(f"  - {line}", file=sys.stderr)
        for name in missing:
            print(f"Start {name} with: {START[name]}", file=sys.stderr)
        return 1
    print("services: PostgreSQL, Redis, MariaDB, RabbitMQ and NATS JetStream answer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
