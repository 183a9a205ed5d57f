"""`tandem up` stops its whole cluster however it is told to: Ctrl-C even when its shell
started it with SIGINT ignored (a background job of a script), and a supervisor killed
with SIGKILL takes its services with it (none keeps serving, orphaned, on its port)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.process import free_port
from tests.cluster.launch import alive, descendants, wait_ready

pytestmark = pytest.mark.slow
ARGS = ["--mode", "colocated", "--worker-arg=--dtype=float32", "--worker-arg=--kv-blocks=64"]


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def _start(model: Path, **popen) -> tuple[subprocess.Popen, list[int]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--model", str(model),
                             "--port", str(port), *ARGS], stderr=subprocess.DEVNULL,
                            start_new_session=True, **popen)
    wait_ready(f"http://127.0.0.1:{port}", proc, time.monotonic() + 180, "tandem up")
    kids = descendants(proc.pid)
    assert len(kids) >= 2, kids  # the colocated engine and the router, at least
    return proc, kids


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_ctrl_c_stops_a_cluster_started_with_sigint_ignored(tiny_model_dir) -> None:
    proc, kids = _start(tiny_model_dir, preexec_fn=_ignore_sigint)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert _wait_gone(kids, 15) == []
    finally:
        for p in [proc.pid, *kids]:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_services_die_with_a_killed_supervisor(tiny_model_dir) -> None:
    proc, kids = _start(tiny_model_dir)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _wait_gone(kids, 30) == []  # SIGTERM from the kernel: they drain and exit
    finally:
        for p in kids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
