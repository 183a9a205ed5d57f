"""Batch-1 decode TPOT in process, alone and beside a small periodic load: how much a
server's own HTTP and gRPC work (the router, the worker's event loop, the client) can
cost the engine's step on a host with few cores (docs/performance.md, "c1 over HTTP").

Each round times --tokens decode steps of one engine (bench/c1_ab.py's tpot: the steps
after the prompt's first token) three times: alone; beside a thread of this process that spins
--busy-ms of Python every --period-ms (it takes the GIL); beside a separate process
doing the same (a fresh interpreter, not a fork: it takes only CPU). Printed: each
round's three TPOTs, then medians and the loaded/alone ratios. --threads sets the
engine's threads; --engine-cpus and --load-cpus pin the engine's process (before its
threads start) and the load to CPUs, e.g. ``--threads 1 --engine-cpus 0 --load-cpus 1``
keeps them on different cores.

    python bench/c1_noise.py [--busy-ms 0.5] [--period-ms 5] [--threads N]
        [--engine-cpus 0] [--load-cpus 1] [--rounds 4]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.c1_ab import build, tpot  # noqa: E402
from engine.native import simd_flags  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402


SETTLE_S = 0.3
"""Time the load gets before the timing starts, so that the spawned interpreter's own
start-up (tens of ms of CPU, on the engine's CPUs until it pins itself) is not inside the
timed tokens."""


def cpus(text: str | None) -> set[int] | None:
    return {int(c) for c in text.split(",")} if text else None


def load(stop: threading.Event, busy_s: float, period_s: float, pin: set[int] | None) -> None:
    """Spin busy_s, sleep period_s, until stop is set (a thread: pins only itself)."""
    if pin:
        os.sched_setaffinity(0, pin)
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < busy_s:
            pass
        time.sleep(period_s)


def spawn_load(busy_s: float, period_s: float, pin: set[int] | None) -> subprocess.Popen:
    """The load in a fresh interpreter: not a fork of this process, whose pages a fork
    would make copy-on-write for the engine's next writes (the router and the client of a
    server are not forks of the worker either)."""
    code = ("import os, time\n"
            + (f"os.sched_setaffinity(0, {sorted(pin)})\n" if pin else "")
            + f"while True:\n    t = time.perf_counter()\n"
            f"    while time.perf_counter() - t < {busy_s}:\n        pass\n"
            f"    time.sleep({period_s})\n")
    return subprocess.Popen([sys.executable, "-c", code])


@contextlib.contextmanager
def beside(mode: str, busy_s: float, period_s: float, pin: set[int] | None) -> Iterator[None]:
    """The load for one timing: none ("alone"), a thread of this process, or a spawned
    process; it runs SETTLE_S before the block and stops when the block ends."""
    if mode == "alone":
        yield
        return
    stop = threading.Event()
    if mode == "thread":
        worker = threading.Thread(target=load, args=(stop, busy_s, period_s, pin), daemon=True)
        worker.start()
    else:
        proc = spawn_load(busy_s, period_s, pin)
    try:
        time.sleep(SETTLE_S)
        yield
    finally:
        if mode == "thread":
            stop.set()
            worker.join()
        else:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy-ms", type=float, default=0.5, help="the load's spin per period")
    ap.add_argument("--period-ms", type=float, default=5.0, help="the load's sleep per period")
    ap.add_argument("--threads", type=int, default=0, help="engine threads (default: its own)")
    ap.add_argument("--engine-cpus", help="CPUs of this process, e.g. 0 (set before the engine)")
    ap.add_argument("--load-cpus", help="CPUs of the load, e.g. 1")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if args.engine_cpus:
        os.sched_setaffinity(0, cpus(args.engine_cpus))
    busy, period, pin = args.busy_ms / 1e3, args.period_ms / 1e3, cpus(args.load_cpus)
    eng = build(str(default_model_path()), {"num_threads": args.threads} if args.threads else {},
                {})
    print(f"SIMD flags: {' '.join(simd_flags())}; engine threads {args.threads or 'default'}, "
          f"CPUs {args.engine_cpus or 'any'}; load {args.busy_ms} ms busy every "
          f"{args.period_ms} ms, CPUs {args.load_cpus or 'any'}", flush=True)
    vocab = eng.runner.model.cfg.vocab_size

    def prompt(r: int) -> list[int]:
        return [(7 * r + 13 * j) % (vocab - 10) + 10 for j in range(128)]

    tpot(eng, {}, prompt(args.rounds), 8)  # warm-up
    got: dict[str, list[float]] = {"alone": [], "thread": [], "process": []}
    for r in range(args.rounds):
        for mode, times in got.items():
            with beside(mode, busy, period, pin):
                times.append(tpot(eng, {}, prompt(r), args.tokens)[0])
        print(f"round {r}: " + ", ".join(f"{m} {t[-1]:.2f} ms" for m, t in got.items()),
              flush=True)
    med = {m: statistics.median(t) for m, t in got.items()}
    print("medians: " + ", ".join(f"{m} {v:.2f} ms" for m, v in med.items())
          + f"; thread/alone {med['thread'] / med['alone']:.2f}, "
          f"process/alone {med['process'] / med['alone']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
