"""`tandem up`: a whole local cluster — N prefill workers, M decode workers and
the router on 127.0.0.1:8000 — each worker pinned to its own core where the
machine has enough; the router then runs on the prefill workers' cores, so decode
workers have theirs to themselves. Ctrl-C (or SIGTERM) stops every process it
started."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from router.config import RouterConfig

READY_TIMEOUT_S = 600


def add_up_args(p: argparse.ArgumentParser) -> None:
    from tandem.commands import add_model_arg

    add_model_arg(p)
    p.add_argument("--mode", choices=("disagg", "colocated"), default="disagg",
                   help="disagg: prefill and decode pools; colocated: one engine does both "
                        "(the baseline) (default: disagg)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default: 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default: 1)")
    p.add_argument("--kv-transfer", choices=("nixl", "tcp"), default="nixl",
                   help="KV transfer backend between workers (default: nixl)")
    p.add_argument("--host", default="127.0.0.1", help="router bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="router HTTP port (default: 8000)")
    p.add_argument("--kv-blocks", type=int, default=None, help="cap each worker's KV pool")
    p.add_argument("--swap-space", type=float, default=None,
                   help="host swap pool per worker, GiB (default: the workers' 1.0)")
    p.add_argument("--preemption-mode", choices=("auto", "swap", "recompute"), default=None,
                   help="how a full decode worker preempts (default: the workers' auto)")
    p.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16 (default: auto)")
    p.add_argument("--max-model-len", type=int, default=None, help="context window")
    p.add_argument("--local-prefill-threshold", type=int, default=32,
                   help="prompts with at most this many uncached tokens prefill on the decode "
                        "worker (default: 32)")
    p.add_argument("--routing", choices=("prefix", "round_robin"), default="prefix",
                   help="placement policy (default: prefix)")
    p.add_argument("--log-requests", default=None, metavar="PATH",
                   help="the router writes each request's trace (workers, predicted and "
                        "realized prefix hit, bytes moved, fallbacks) as a JSON line to PATH")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every worker (repeat), e.g. --worker-arg=--no-enable-prefix-caching")
    p.add_argument("--prefill-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for prefill workers only (repeat), after --worker-arg, "
                        "e.g. --prefill-arg=--kv-blocks=200")
    p.add_argument("--decode-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for decode workers only (repeat; in colocated mode, "
                        "for the one engine), after --worker-arg")


def _plan_cores(n_workers: int) -> list[set[int] | None]:
    """One core per worker when there are enough; otherwise no pinning."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n_workers or n_workers < 2:
        return [None] * n_workers
    return [{cores[i]} for i in range(n_workers)]


def _spawn_worker(role: str, args: argparse.Namespace, model: str, ready: Path,
                  cores: set[int] | None, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tandem.cli", "--log-level", args.log_level, role,
           "--model", model, "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready),
           "--kv-transfer", args.kv_transfer, "--dtype", args.dtype,
           "--num-threads", str(threads), "--metrics-port", "0"]
    if args.kv_blocks:
        cmd += ["--kv-blocks", str(args.kv_blocks)]
    if args.swap_space is not None:
        cmd += ["--swap-space", str(args.swap_space)]
    if args.preemption_mode:
        cmd += ["--preemption-mode", args.preemption_mode]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    cmd += args.worker_arg + (args.prefill_arg if role == "prefill" else args.decode_arg)
    proc = subprocess.Popen(cmd, start_new_session=True)
    if cores:
        os.sched_setaffinity(proc.pid, cores)
    return proc


def _wait_ready(procs: list[tuple[str, subprocess.Popen, Path]]) -> list[str]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    addrs: list[str | None] = [None] * len(procs)
    while None in addrs:
        for i, (role, proc, ready) in enumerate(procs):
            if addrs[i] is None and ready.exists():
                addrs[i] = ready.read_text().split()[0]
            if proc.poll() is not None:
                raise RuntimeError(f"{role} worker exited with code {proc.returncode} "
                                   "before it was ready (see its messages above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not ready after {READY_TIMEOUT_S}s")
        time.sleep(0.1)
    return addrs  # type: ignore[return-value]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def run_up(args: argparse.Namespace) -> int:
    from router.main import run_router
    from tandem.commands import resolve_model

    model = resolve_model(args)
    roles = (["decode"] if args.mode == "colocated"
             else ["prefill"] * args.prefill + ["decode"] * args.decode)
    if args.mode == "disagg" and (args.prefill < 0 or args.decode < 1):
        raise ValueError("--decode must be >= 1 and --prefill >= 0")
    plan = _plan_cores(len(roles))
    ncores = len(os.sched_getaffinity(0))
    procs: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    with tempfile.TemporaryDirectory(prefix="tandem-up-") as tmp:
        try:
            started = []
            for i, (role, cores) in enumerate(zip(roles, plan)):
                threads = len(cores) if cores else max(1, ncores // len(roles))
                ready = Path(tmp) / f"{role}{i}.ready"
                p = _spawn_worker(role, args, model, ready, cores, threads)
                procs.append(p)
                started.append((role, p, ready))
            addrs = _wait_ready(started)
            config = RouterConfig(
                model=model, host=args.host, port=args.port,
                prefill=tuple(a for r, a in zip(roles, addrs) if r == "prefill"),
                decode=tuple(a for r, a in zip(roles, addrs) if r == "decode"),
                local_prefill_threshold=-1 if args.mode == "colocated" else args.local_prefill_threshold,
                routing=args.routing, max_model_len=args.max_model_len or 8192,
                log_requests=args.log_requests)
            print(f"tandem up: http://{args.host}:{args.port}/v1 ({args.mode}: "
                  f"{roles.count('prefill')} prefill, {roles.count('decode')} decode, "
                  f"kv-transfer {args.kv_transfer}); Ctrl-C stops", file=sys.stderr, flush=True)
            for (role, _, ready) in started:
                grpc_addr, mport = ready.read_text().split()
                print(f"  {role:7} gRPC {grpc_addr}  metrics http://127.0.0.1:{mport}/metrics",
                      file=sys.stderr, flush=True)
            prefill_cores = set().union(*(c for r, c in zip(roles, plan) if r == "prefill" and c))
            if prefill_cores:
                # The router shares the prefill workers' cores: decode workers keep theirs
                # to themselves (TPOT is the latency-critical path; prefill is bursty).
                os.sched_setaffinity(0, prefill_cores)
            run_router(config, args.log_level)
        except KeyboardInterrupt:
            pass
        finally:
            _stop(procs)
    return 0
