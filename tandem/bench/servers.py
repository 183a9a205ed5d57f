"""Start and stop the servers the comparison scripts in bench/ measure: `tandem up`
in a given mode, or any command that serves an OpenAI API (llama.cpp's server),
each in its own process group, ready when a URL answers 200."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence


from tandem.process import free_port, wait_http  # noqa: F401 - free_port: for the scenarios


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    wait_http(url, timeout_s, what, proc, interval_s=0.2)


def stop(proc: subprocess.Popen, timeout_s: float = 20) -> None:
    """SIGTERM the process group, SIGKILL after timeout_s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def serve(cmd: Sequence[str], ready_url: str, what: str, timeout_s: float = 600,
          log: Path | None = None, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run cmd in a new session until the block ends; output goes to log (or nowhere)."""
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(list(cmd), start_new_session=True, stdout=out,
                            stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        wait_ready(ready_url, proc, timeout_s, what)
        yield proc
    finally:
        stop(proc)
        if log:
            out.close()


def tandem_bin() -> list[str]:
    """The tandem CLI of this interpreter (works from a checkout without the script)."""
    return [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING"]


@dataclass
class Server:
    """A running server: its base URL (ending in /v1) and its process."""

    url: str
    proc: subprocess.Popen

    def children(self) -> list[int]:
        """Pids of the processes it started (the workers of `tandem up`)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                             text=True).stdout
        return [int(p) for p in out.split()]

    def cmdline(self, pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return ""


@contextlib.contextmanager
def tandem_up(*args: str, model: str | None = None, port: int | None = None,
              log: Path | None = None) -> Iterator[Server]:
    """`tandem up ARGS` on a free port, until the block ends."""
    port = port or free_port()
    cmd = [*tandem_bin(), "up", "--port", str(port), *args]
    if model:
        cmd += ["--model", model]
    url = f"http://127.0.0.1:{port}"
    with serve(cmd, url + "/ready", f"tandem up {' '.join(args)}", log=log) as proc:
        yield Server(url + "/v1", proc)


def load_note() -> str:
    n = os.cpu_count() or 1
    return f"load average {os.getloadavg()[0]:.2f} on {n} CPUs"


def _proc_table() -> dict[int, tuple[int, int, int, int]]:
    """pid -> (ppid, CPU ticks of it and its reaped children: utime+stime+cutime+cstime,
    start time in ticks since boot (with the pid, it names one process), CPU ticks of it
    alone: utime+stime)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2:].split()  # the fields after "pid (comm) "
        out[int(entry)] = (int(f[1]), sum(int(x) for x in f[11:15]), int(f[19]),
                           int(f[11]) + int(f[12]))
    return out


class _Tree:
    """The CPU ticks of this process's tree, live or reaped, and of every process that
    was in it once and left it: a server's helper (vLLM's engine core) re-parented to
    init when the server stops is still ours, and so is its CPU time, which the tree
    read at the end alone counted as another process's. Sampled every ``period`` s by
    a daemon thread; time a leaver used after the last sample before it died is not
    seen."""

    def __init__(self, period: float = 0.25) -> None:
        self.period = period
        self.members: set[tuple[int, int]] = set()  # (pid, start) in the tree last sample
        self.left: dict[tuple[int, int], int] = {}  # (pid, start) -> its ticks, last seen
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> _Tree:
        self.ticks()
        self._thread = threading.Thread(target=self._run, name="noise-tree", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.ticks()

    def ticks(self) -> int:
        """Our ticks now: the tree's (with what its members reaped), plus each process
        that left it, and each of a leaver's descendants, on its own time as last seen
        (its own: a leaver's reaped children are counted once, by themselves)."""
        with self._lock:
            table = _proc_table()
            children: dict[int, list[int]] = {}
            for pid, (ppid, *_) in table.items():
                children.setdefault(ppid, []).append(pid)

            def under(roots: list[int]) -> set[tuple[int, int]]:
                found, todo = set(), list(roots)
                while todo:
                    pid = todo.pop()
                    if pid in table:
                        found.add((pid, table[pid][2]))
                        todo += children.get(pid, [])
                return found
            tree = under([os.getpid()])
            alive = {(pid, row[2]) for pid, row in table.items()}
            for key in self.members - tree:
                if key in alive:  # re-parented out of the tree: still ours
                    self.left.setdefault(key, 0)
            roots = [pid for pid, start in self.left if (pid, start) in alive]
            outside = under(roots) - tree
            for key in outside:
                self.left[key] = table[key[0]][3]
            self.members = tree
            return sum(table[pid][1] for pid, _ in tree) + \
                sum(t for key, t in self.left.items() if key not in tree)


def _machine_busy_ticks() -> int:
    """Busy CPU ticks of the whole machine (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return v[0] + v[1] + v[2] + v[5] + v[6]


class Noise:
    """CPU time used by processes outside this one's tree between start() and
    report(): the machine's busy time minus our own (``_Tree``: processes that left the
    tree are still ours). Other work on the box competes with the measurement; this
    says how much (Linux only)."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.busy0 = self.mine0 = 0
        self.tree: _Tree | None = None

    def start(self) -> Noise:
        self.tree = _Tree().start()
        self.t0, self.busy0, self.mine0 = time.monotonic(), _machine_busy_ticks(), \
            self.tree.ticks()
        return self

    def others_cpu_s(self) -> float:
        busy = _machine_busy_ticks() - self.busy0
        mine = self.tree.ticks() - self.mine0
        return max(0, busy - mine) / os.sysconf("SC_CLK_TCK")

    def report(self) -> str:
        """The measurement's line; it ends the measurement (the tree's sampler stops)."""
        if not self.t0:
            return "other processes: not measured"
        wall = max(time.monotonic() - self.t0, 1e-9)
        cpu = self.others_cpu_s()
        self.tree.stop()
        share = cpu / (wall * (os.cpu_count() or 1))
        return (f"other processes used {cpu:.1f} CPU-s over {wall:.0f}s "
                f"({share:.0%} of the machine){'  <- results disturbed' if share > 0.05 else ''}")
