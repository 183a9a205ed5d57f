"""Start real worker and router processes on loopback for end-to-end tests."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from auth.grpc_auth import sync_channel
from auth.secret import load_cluster_secret

from proto import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tandem.process import free_port  # noqa: F401 - tests import it from here
from tandem.supervisor import die_with_parent

CLI = [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING"]


@dataclass
class Proc:
    role: str
    popen: subprocess.Popen
    addr: str = ""
    metrics_port: int = 0

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


@dataclass
class Cluster:
    prefill: list[Proc] = field(default_factory=list)
    decode: list[Proc] = field(default_factory=list)
    router: Proc | None = None
    url: str = ""

    def metrics(self, proc: Proc) -> str:
        return httpx.get(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).text

    def channel(self, proc: Proc):
        """A blocking gRPC channel to a worker, carrying the cluster secret."""
        return sync_channel(proc.addr, load_cluster_secret(None))

    def load(self, proc: Proc) -> common_pb2.WorkerLoad:
        stub_cls = (prefill_pb2_grpc.PrefillStub if proc.role == "prefill"
                    else decode_pb2_grpc.DecodeStub)
        with sync_channel(proc.addr, load_cluster_secret(None)) as ch:
            return stub_cls(ch).GetLoad(common_pb2.LoadRequest(), timeout=5)

    def leak_check(self) -> None:
        """Over the wire: no lease, nothing queued or running, every block free or cached."""
        for proc in self.prefill + self.decode:
            if proc.popen.poll() is not None:
                continue
            for _ in range(50):
                load = self.load(proc)
                if (load.active_leases, load.num_running, load.num_waiting,
                        load.swap_used_blocks) == (0, 0, 0, 0) and \
                        load.free_blocks == load.total_blocks:
                    break
                time.sleep(0.1)
            assert load.active_leases == 0, f"{proc.role} holds {load.active_leases} leases"
            assert load.num_running == load.num_waiting == 0, f"{proc.role} still busy: {load}"
            assert load.free_blocks == load.total_blocks, f"{proc.role} leaked blocks: {load}"
            assert load.swap_used_blocks == 0, f"{proc.role} leaked swap blocks: {load}"


def stream_events(r: httpx.Response) -> Iterator[dict]:
    """The events of an OpenAI streaming response as they arrive (none for [DONE]); an
    error event fails the test."""
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        assert "error" not in ev, ev
        yield ev


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(CLI + args, start_new_session=True, stdout=subprocess.DEVNULL,
                            preexec_fn=die_with_parent())


@contextlib.contextmanager
def cluster(model: str | Path, backend: str = "tcp", n_prefill: int = 1, n_decode: int = 1,
            worker_args: list[str] = (), router_args: list[str] = (),
            decode_args: Sequence[Sequence[str]] = ()):
    """decode_args: more flags for the first decode workers, one list each."""
    c = Cluster()
    roles = [("prefill", ())] * n_prefill + [
        ("decode", decode_args[i] if i < len(decode_args) else ()) for i in range(n_decode)]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i, (role, own) in enumerate(roles):
                ready = Path(tmp) / f"{i}.ready"
                p = _spawn([role, "--model", str(model), "--port", "0", "--metrics-port", "0",
                            "--ready-file", str(ready), "--kv-transfer", backend,
                            "--num-threads", "1", *worker_args, *own])
                proc = Proc(role, p)
                (c.prefill if role == "prefill" else c.decode).append(proc)
                proc.ready = ready  # type: ignore[attr-defined]
            deadline = time.monotonic() + 240
            for proc in c.prefill + c.decode:
                while not proc.ready.exists():  # type: ignore[attr-defined]
                    assert proc.popen.poll() is None, f"{proc.role} worker died at startup"
                    assert time.monotonic() < deadline, "workers not ready in time"
                    time.sleep(0.1)
                addr, mport = proc.ready.read_text().split()  # type: ignore[attr-defined]
                proc.addr, proc.metrics_port = addr, int(mport)
            port = free_port()
            args = ["router", "--model", str(model), "--port", str(port), *router_args,
                    *_worker_flags(c)]
            c.router = Proc("router", _spawn(args))
            c.url = f"http://127.0.0.1:{port}"
            wait_ready(c.url, c.router.popen, deadline, "router")
            yield c
        finally:
            for proc in [c.router] + c.prefill + c.decode:
                if proc is not None and proc.popen.poll() is None:
                    os.killpg(proc.popen.pid, signal.SIGTERM)
            for proc in [c.router] + c.prefill + c.decode:
                if proc is not None:
                    try:
                        proc.popen.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        proc.kill()


def _worker_flags(c: Cluster) -> list[str]:
    return ([a for p in c.prefill for a in ("--prefill", p.addr)]
            + [a for p in c.decode for a in ("--decode", p.addr)])


@contextlib.contextmanager
def another_router(c: Cluster, model: str | Path, router_args: list[str] = ()):
    """A second router over the cluster's workers, with its own flags (one without the
    first's API keys, say); yields its URL, stops it at the end."""
    port = free_port()
    proc = _spawn(["router", "--model", str(model), "--port", str(port), *router_args,
                   *_worker_flags(c)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, time.monotonic() + 120, "router")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_ready(url: str, proc: subprocess.Popen, deadline: float, what: str) -> None:
    """Until ``url``/ready answers 200; AssertionError if ``proc`` dies or time runs out."""
    while True:
        assert proc.poll() is None, f"{what} exited"
        assert time.monotonic() < deadline, f"{what} not ready"
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


@contextlib.contextmanager
def tandem_up(model: str | Path, args: list[str], ready_s: float = 180):
    """`tandem up` on a free loopback port; yields the router's URL, stops it with SIGINT."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--model", str(model),
                             "--port", str(port), *args],
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, time.monotonic() + ready_s, "tandem up")
        yield url
    finally:
        interrupt(proc)


def interrupt(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Ctrl-C to a process group (`tandem up` stops its cluster), SIGKILL if it hangs."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def descendants(pid: int) -> list[int]:
    """Every process below pid (tandem up's services run in their own sessions, so
    killing its process group does not reach them)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        up = todo.pop()
        kids = [child for child, ppid in parent.items() if ppid == up]
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
