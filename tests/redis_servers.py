"""Private redis-server processes for the tests: one server, or a three-node Redis Cluster.

A plain module, not a conftest: the fault tests kill, freeze and restart their own server, and
the cluster fixture in conftest builds a cluster once per session. Every server binds loopback
only, keeps nothing on disk (``--save ''``, no AOF) and is killed when its context ends.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

START_TIMEOUT = 20.0  # seconds for a server to answer, or a cluster to agree on its slots
POLL = 0.05


def installed() -> str | None:
    """Why private servers cannot run here (None when redis-server and redis-cli exist)."""
    missing = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not on PATH" if missing else None


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports nothing listens on (all held open while picking, so
    the kernel cannot hand one out twice)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def wait_for(condition: Callable[[], bool], what: str, timeout: float = START_TIMEOUT) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(POLL)


def _answers(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_connect_timeout=0.2, socket_timeout=1) as probe:
            return bool(probe.ping())
    except redis.RedisError:
        return False


@contextmanager
def redis_server(port: int, *options: str) -> Iterator[subprocess.Popen[bytes]]:
    """A private redis-server on loopback ``port``, up once it answers; killed on exit.

    ``options`` are more ``--name value`` arguments (cluster mode, a working directory).
    """
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            *options,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: server.poll() is not None or _answers(port), f"redis-server on port {port}"
        )
        if server.poll() is not None:
            raise AssertionError(f"redis-server on port {port} exited ({server.returncode})")
        yield server
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


@dataclass(frozen=True)
class Cluster:
    """A running cluster: its primaries' client ports."""

    ports: list[int]

    @property
    def url(self) -> str:
        """The store URL, every node given as a seed."""
        seeds = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        return f"redis+cluster://{seeds}/0"


def _cluster_ok(port: int, nodes: int) -> bool:
    try:
        with redis.Redis(port=port, socket_timeout=1) as node:
            info = node.execute_command("CLUSTER", "INFO")
    except redis.RedisError:
        return False
    text = info.decode() if isinstance(info, bytes) else str(info)
    fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
    return (
        fields.get("cluster_state") == "ok"
        and fields.get("cluster_slots_ok") == "16384"
        and fields.get("cluster_known_nodes") == str(nodes)
    )


@contextmanager
def redis_cluster(directory: Path, nodes: int = 3) -> Iterator[Cluster]:
    """A private Redis Cluster of ``nodes`` primaries (no replicas) on free loopback ports,
    up once every node says ``cluster_state:ok``; every node killed on exit."""
    ports = free_ports(2 * nodes)
    client_ports, bus_ports = ports[:nodes], ports[nodes:]
    with ExitStack() as stack:
        for port, bus in zip(client_ports, bus_ports, strict=True):
            stack.enter_context(
                redis_server(
                    port,
                    "--cluster-enabled",
                    "yes",
                    # An explicit bus port: the default (port + 10000) may be taken or > 65535.
                    "--cluster-port",
                    str(bus),
                    "--cluster-config-file",
                    str(directory / f"nodes-{port}.conf"),
                    "--dir",
                    str(directory),
                )
            )
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in client_ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=START_TIMEOUT,
        )
        for port in client_ports:
            wait_for(lambda port=port: _cluster_ok(port, nodes), f"cluster node {port} to be ok")
        yield Cluster(client_ports)
