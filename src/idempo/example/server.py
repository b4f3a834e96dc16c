"""Serve the example payments API: in this process with uvicorn, or as a child process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx

from .app import DEFAULT_LEASE, EVENTS, create_app


def serve(
    store_url: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    lease: timedelta = DEFAULT_LEASE,
    events: str = EVENTS,
    log_level: str = "info",
) -> None:
    """Serve until interrupted."""
    import uvicorn  # noqa: PLC0415 - the demo extra

    app = create_app(store_url, lease=lease, events=events)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ExampleServer:
    """The example API in a process of its own on a free loopback port, so a storm (or a
    test) can SIGKILL it mid-request and start it again on the same port and store."""

    def __init__(
        self,
        url: str,
        log: Path,
        *,
        lease: float = 10.0,
        port: int | None = None,
        events: str = EVENTS,
    ) -> None:
        self.url = url
        self.events = events
        self.port = port or free_port()
        self.log = log
        self.lease = lease
        self.base = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "idempo.example", "--store", self.url,
                   "--port", str(self.port), "--lease", str(self.lease),
                   "--events", self.events]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log)  # noqa: S603 - our own module
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the example server exited:\n{self.log_tail()}")
            try:
                httpx.get(f"{self.base}/demo/ledger", timeout=1).raise_for_status()
            except httpx.HTTPError:
                time.sleep(0.05)
            else:
                return
        raise RuntimeError(f"the example server did not answer in 30 s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 25) -> str:
        """The last ``lines`` of the server's output (its errors, a traceback), to show
        rather than point at: the log lives in a directory removed at the end."""
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no output)"
        return "\n".join(text.rstrip().splitlines()[-lines:]) or "(no output)"

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def ledger(self) -> dict[str, int]:
        answer: dict[str, int] = httpx.get(f"{self.base}/demo/ledger", timeout=10).json()
        return answer
