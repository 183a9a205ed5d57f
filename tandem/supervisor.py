"""The processes of `tandem up` and their supervision.

Each service (prefill and decode workers, the router) is a child in its own process
group, with a port fixed at start-up, so a restarted child comes back where its
peers look for it. The supervisor polls the children; one that exits is restarted
(unless --no-restart) and one that exits MAX_RESTARTS times within RESTART_WINDOW_S
stops the cluster with status 1. Stopping sends SIGTERM to every child (workers then
drain) and SIGKILL to what is left after STOP_GRACE_S. On Linux each child also gets
SIGTERM from the kernel when the supervisor dies, however it dies (SIGKILL, a crash),
so no service outlives `tandem up` holding its port and memory.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from auth.secret import load_cluster_secret, write_secret
from tandem.process import free_port, wait_http

READY_TIMEOUT_S = 600.0
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
STOP_GRACE_S = 10.0
POLL_S = 0.2


@dataclass
class Child:
    name: str
    cmd: list[str]
    cores: set[int] | None = None
    ready_file: Path | None = None
    proc: subprocess.Popen | None = None
    exits: list[float] = field(default_factory=list)

    def start(self) -> None:
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(self.cmd, start_new_session=True,
                                     preexec_fn=die_with_parent())
        if self.cores:
            os.sched_setaffinity(self.proc.pid, self.cores)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


_PR_SET_PDEATHSIG = 1


def die_with_parent():
    """A preexec_fn (Linux; None elsewhere): the child gets SIGTERM when this process
    dies (prctl PR_SET_PDEATHSIG), and exits at once if it already has."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the supervisor died between fork and prctl
            os._exit(1)
    return arm


def plan_cores(n_workers: int) -> list[set[int] | None]:
    """One core per worker when there are enough; otherwise no pinning."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n_workers or n_workers < 2:
        return [None] * n_workers
    return [{cores[i]} for i in range(n_workers)]


class Cluster:
    def __init__(self, args: argparse.Namespace, model: str) -> None:
        self.args = args
        self.model = model
        self._tmp = tempfile.TemporaryDirectory(prefix="tandem-up-")
        self.workers: list[Child] = []
        self.router: Child | None = None
        self._plan()

    # -- the plan -----------------------------------------------------------------------
    def _plan(self) -> None:
        a = self.args
        roles = (["decode"] if a.mode == "colocated"
                 else ["prefill"] * a.prefill + ["decode"] * a.decode)
        plan = plan_cores(len(roles))
        ncores = len(os.sched_getaffinity(0))
        addrs: dict[str, list[str]] = {"prefill": [], "decode": []}
        if self.args.cluster_secret_file:
            self.secret_file = Path(self.args.cluster_secret_file)
            load_cluster_secret(str(self.secret_file))  # unusable: say so now, naming it
        else:  # one per run, 0600; children get its path, not its value
            self.secret_file = Path(self._tmp.name) / "cluster-secret"
            write_secret(self.secret_file)
        ports = [free_port() for _ in roles]
        self.prefill_addrs = [f"127.0.0.1:{p}" for r, p in zip(roles, ports) if r == "prefill"]
        for i, (role, cores, port) in enumerate(zip(roles, plan, ports)):
            mport = free_port()
            threads = len(cores) if cores else max(1, ncores // len(roles))
            ready = Path(self._tmp.name) / f"{role}{i}.ready"
            self.workers.append(Child(f"{role}{i}", self._worker_cmd(role, port, mport, ready,
                                                                      threads), cores, ready))
            addrs[role].append(f"127.0.0.1:{port}")
        prefill_cores = set().union(*(c for r, c in zip(roles, plan) if r == "prefill" and c))
        # The router shares the prefill workers' cores: decode workers keep theirs to
        # themselves (TPOT is the latency-critical path; prefill is bursty).
        self.router = Child("router", self._router_cmd(addrs), prefill_cores or None)
        self.roles = roles

    def _worker_cmd(self, role: str, port: int, mport: int, ready: Path, threads: int) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "tandem.cli", "--log-level", a.log_level, role,
               "--model", self.model, "--host", "127.0.0.1", "--port", str(port),
               "--ready-file", str(ready), "--kv-transfer", a.kv_transfer, "--dtype", a.dtype,
               "--num-threads", str(threads), "--metrics-port", str(mport),
               "--cluster-secret-file", str(self.secret_file)]
        if role == "decode":
            cmd += [f"--kv-peer={addr}" for addr in self.prefill_addrs]
        for flag, value in (("--kv-blocks", a.kv_blocks), ("--swap-space", a.swap_space),
                            ("--preemption-mode", a.preemption_mode),
                            ("--kv-cache-dtype", a.kv_cache_dtype),
                            ("--max-model-len", a.max_model_len),
                            ("--otlp-traces-endpoint", a.otlp_traces_endpoint),
                            *self._length_flags()):
            if value is not None:
                cmd += [flag, str(value)]
        return cmd + a.worker_arg + (a.prefill_arg if role == "prefill" else a.decode_arg)

    def _router_cmd(self, addrs: dict[str, list[str]]) -> list[str]:
        a = self.args
        threshold = "none" if a.mode == "colocated" else str(a.local_prefill_threshold)
        cmd = [sys.executable, "-m", "tandem.cli", "--log-level", a.log_level, "router",
               "--model", self.model, "--host", a.host, "--port", str(a.port),
               "--local-prefill-threshold", threshold, "--routing", a.routing,
               "--max-model-len", str(a.max_model_len or 8192),
               "--cluster-secret-file", str(self.secret_file)]
        for role in ("prefill", "decode"):
            for addr in addrs[role]:
                cmd += [f"--{role}", addr]
        if a.log_requests:
            cmd += ["--log-requests", a.log_requests]
        if a.otlp_traces_endpoint:
            cmd += ["--otlp-traces-endpoint", a.otlp_traces_endpoint]
        for flag, value in self._length_flags():  # the router checks lengths as workers do
            if value is not None:
                cmd += [flag, str(value)]
        return cmd + a.router_arg

    def _length_flags(self) -> tuple[tuple[str, object], ...]:
        """What the router and every worker must agree on to count a request's length."""
        return (("--kv-policy", self.args.kv_policy),
                ("--max-stream-len", self.args.max_stream_len))

    # -- running ----------------------------------------------------------------------------
    def run(self) -> int:
        for w in self.workers:
            w.start()
        self._wait_workers()
        self.router.start()
        self._wait_router()
        self._banner()
        return self._supervise()

    def _wait_workers(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        print(f"tandem up: starting {len(self.workers)} worker(s): loading the model and "
              "compiling decode steps (a first start takes about a minute; each worker "
              "prints its progress)", file=sys.stderr, flush=True)
        for w in self.workers:
            while not w.ready_file.exists():
                if not w.running:
                    raise RuntimeError(f"{w.name} worker exited with code {w.proc.returncode} "
                                       "before it was ready (see its messages above)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers not ready after {READY_TIMEOUT_S:.0f}s")
                time.sleep(0.1)

    def _wait_router(self) -> None:
        url = f"http://{_connect_host(self.args.host)}:{self.args.port}/health"
        wait_http(url, 60, "the router", self.router.proc)

    def _banner(self) -> None:
        a = self.args
        print(f"tandem up: http://{a.host}:{a.port}/v1 ({a.mode}: {self.roles.count('prefill')} "
              f"prefill, {self.roles.count('decode')} decode, kv-transfer {a.kv_transfer}); "
              "Ctrl-C stops", file=sys.stderr, flush=True)
        for w in self.workers:
            grpc_addr, mport = w.ready_file.read_text().split()
            print(f"  {w.name:8} gRPC {grpc_addr}  metrics http://127.0.0.1:{mport}/metrics",
                  file=sys.stderr, flush=True)

    def _supervise(self) -> int:
        while True:
            time.sleep(POLL_S)
            for child in self.workers + [self.router]:
                if child.running:
                    continue
                code = child.proc.returncode
                now = time.monotonic()
                child.exits = [t for t in child.exits if now - t < RESTART_WINDOW_S] + [now]
                if not self.args.restart:
                    print(f"tandem up: {child.name} exited with code {code}; stopping",
                          file=sys.stderr, flush=True)
                    return 1
                if len(child.exits) > MAX_RESTARTS:
                    print(f"tandem up: {child.name} exited {len(child.exits)} times in "
                          f"{RESTART_WINDOW_S:.0f} s (last code {code}); stopping the cluster",
                          file=sys.stderr, flush=True)
                    return 1
                print(f"tandem up: {child.name} exited with code {code}; restarting it",
                      file=sys.stderr, flush=True)
                child.start()

    def stop(self) -> None:
        children = [c for c in [self.router, *self.workers] if c is not None]
        for c in children:
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for c in children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.signal(signal.SIGKILL)
                c.proc.wait()
        self._tmp.cleanup()


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
