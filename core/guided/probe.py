"""Grammars are built first in a child process that is killed when it runs past its
time budget (core/guided/budget.py: llguidance's build can take tens of seconds on a
short schema, in one Rust call nothing can interrupt).

The child (``python -m core.guided.probe``) imports only llguidance, reads one JSON
request per line (the grammar, the parser limits, a CPU budget) and answers one line
(llguidance's validation error, "" when it builds). The parent keeps a few children
warm (a start is not counted in the budget), one per concurrent check; one that runs
past the budget, dies or answers garbage is killed and replaced. Only a grammar that
built in the child within its budget is then built in-process, where the same work
takes the same time. A Rust panic or a crash (stack, memory) takes down the child,
not the server.

The child also caps its own CPU time per request (RLIMIT_CPU), so it ends by itself
even when its parent died mid-request; it exits when its stdin closes.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

import llguidance

from core.guided.budget import PARSER_LIMITS

PROBE_PROCESSES = 2
"""Children at most (one check each at a time): the workers build constraints on two
threads (engine/engine_thread.py), and a flood of checks waits for a child here."""
START_SECONDS = 60.0
"""How long a new child may take to import llguidance and say it is ready."""


class OverBudget(ValueError):
    """The grammar took longer than its budget to build, or crashed the builder."""


class _Child:
    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # the child imports this same code
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "core.guided.probe"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        if self._read(START_SECONDS) != {"ready": True}:
            self.kill()
            raise RuntimeError("the grammar probe process did not start")

    def ask(self, grammar: str, seconds: float) -> str:
        """llguidance's validation error ("" when it builds); OverBudget past seconds."""
        line = json.dumps({"grammar": grammar, "limits": PARSER_LIMITS,
                           "cpu_seconds": seconds}) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except OSError:
            raise OverBudget("crashed the grammar compiler") from None
        reply = self._read(seconds)
        if reply is None:
            raise OverBudget(f"takes more than {seconds:g} s to compile (the budget)")
        if not isinstance(reply, dict) or not isinstance(reply.get("error"), str):
            raise OverBudget(f"crashed the grammar compiler (exit {self.proc.poll()})")
        return reply["error"]

    def _read(self, seconds: float) -> object:
        """The child's next reply; None when none came within seconds; "" at its end."""
        ready, _, _ = select.select([self.proc.stdout], [], [], seconds)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        try:
            return json.loads(line) if line else ""
        except json.JSONDecodeError:
            return ""

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


class GrammarProbe:
    """Thread-safe. Builds a grammar in a child process within a time budget."""

    def __init__(self, processes: int = PROBE_PROCESSES) -> None:
        self._slots = threading.BoundedSemaphore(processes)
        self._lock = threading.Lock()
        self._idle: list[_Child] = []

    def check(self, grammar: str, seconds: float) -> str:
        """llguidance's error for the grammar ("" when it builds within seconds);
        OverBudget when it does not (the child is then killed)."""
        with self._slots:
            with self._lock:
                child = self._idle.pop() if self._idle else None
            child = child or _Child()
            try:
                error = child.ask(grammar, seconds)
            except OverBudget:
                child.kill()
                raise
            with self._lock:
                self._idle.append(child)
            return error

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


_probe: GrammarProbe | None = None
_probe_lock = threading.Lock()


def probe() -> GrammarProbe:
    """The process's probe (one pool of children for every compiler in it)."""
    global _probe
    with _probe_lock:
        if _probe is None:
            _probe = GrammarProbe()
        return _probe


def _serve() -> None:
    """The child's loop."""
    import resource

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cap = int(usage.ru_utime + usage.ru_stime + 2 * request["cpu_seconds"]) + 1
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        resource.setrlimit(resource.RLIMIT_CPU,
                           (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
        error = llguidance.LLMatcher.validate_grammar(
            request["grammar"], None, limits=llguidance.LLParserLimits(**request["limits"]))
        print(json.dumps({"error": error}), flush=True)


if __name__ == "__main__":
    _serve()
