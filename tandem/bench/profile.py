"""Sampling profiles of a server process during a benchmark, summarised as text.

py-spy (``pip install py-spy``) records the process's Python stacks in its "raw"
(collapsed) format; ``summarize`` turns that into three short tables: the share
of samples per thread, the hottest leaf frames and the hottest functions
(inclusive). Text, so it can go into a report without a flame graph file.
"""
from __future__ import annotations

import collections
import contextlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator


def py_spy() -> str | None:
    """The py-spy executable next to this interpreter or on PATH, else None."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


def start_record(pid: int, seconds: float, out: Path, rate: int = 100) -> subprocess.Popen | None:
    """Start `py-spy record` on pid in the background (raw format, native frames off,
    idle threads left out). None when py-spy is not installed."""
    exe = py_spy()
    if exe is None:
        print("note: py-spy is not installed; no profile (pip install py-spy)", file=sys.stderr)
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(int(seconds)),
                             "-r", str(rate), "-f", "raw", "-o", str(out), "--threads",
                             "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def sampled(pid: int | None, seconds: float, name: str, what: str) -> Iterator[None]:
    """Sample pid with py-spy for the first `seconds` of the block, then print the
    summary headed "py-spy, WHAT, first Ns:". The raw file is kept in the temp folder
    as NAME.pyspy.txt. Does nothing when pid is None or seconds is 0."""
    rec = None
    if pid is not None and seconds:
        out = Path(tempfile.gettempdir()) / f"{name}.pyspy.txt"
        rec = start_record(pid, seconds, out)
    yield
    if rec is not None:
        rec.wait()
        print(f"\npy-spy, {what}, first {seconds:g}s:\n" + summarize(out), flush=True)


def summarize(raw: Path, top: int = 12) -> str:
    """Thread shares, top leaf frames and top inclusive functions of a raw py-spy file."""
    total = 0
    threads: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        threads[frames[0].split(": ", 1)[-1].strip(")'\"")] += n
        leaves[frames[-1]] += n
        for name in {f.split(" (")[0] for f in frames[1:]}:
            inclusive[name] += n
    if not total:
        return f"(no samples in {raw})"
    lines = [f"{total} samples"]
    lines += ["threads:"] + [f"  {n / total:6.1%}  {t}" for t, n in threads.most_common(6)]
    lines += ["hottest frames (self):"] + [f"  {n / total:6.1%}  {f}"
                                           for f, n in leaves.most_common(top)]
    lines += ["hottest functions (inclusive):"] + [f"  {n / total:6.1%}  {f}"
                                                   for f, n in inclusive.most_common(top)]
    return "\n".join(lines)
