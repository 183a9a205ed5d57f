"""Small helpers for the processes tandem starts: a free port, and waiting until a
process answers over HTTP."""
from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, what: str, proc: subprocess.Popen | None = None,
              interval_s: float = 0.1) -> None:
    """Return once GET url answers 200. RuntimeError naming `what` when proc exits first
    or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready "
                               "(see its messages above)")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready at {url} after {timeout_s:.0f}s")
        time.sleep(interval_s)
