"""What the comparison scripts in bench/ share: the bracket around a run (load and noise
before and after), their common flags, and the workloads more than one of them sends.

Results are printed, never asserted: a script says how loaded the machine was so that a
reader can tell a disturbed number from a slow one.
"""
from __future__ import annotations

import argparse
import random
import time
from typing import Any

from tandem.bench import datasets
from tandem.bench.servers import Noise, load_note


class BenchRun:
    """One script's run: made at its start, it prints the machine's load average and starts
    a Noise meter; ``end`` prints the total time, the load average again and what other
    processes took meanwhile."""

    def __init__(self, name: str) -> None:
        self.t_start = time.perf_counter()
        self.noise = Noise().start()
        print(f"{name}: {load_note()} at start", flush=True)

    def end(self) -> None:
        print(f"\ntotal {time.perf_counter() - self.t_start:.0f}s; {load_note()} at end")
        print(self.noise.report())


def add_py_spy_flag(ap: argparse.ArgumentParser, process: str, phase: str) -> None:
    """``--py-spy SECONDS`` (default 0: off): sample ``process`` with py-spy for the first
    SECONDS of each ``phase`` (tandem/bench/profile.py)."""
    ap.add_argument("--py-spy", type=float, default=0, metavar="SECONDS",
                    help=f"sample {process} with py-spy for the first SECONDS of each {phase} "
                         "and print a summary (default: off)")


def add_closed_loop_flags(ap: argparse.ArgumentParser, prompt_len: int, num_prompts: int) -> None:
    """The workload of a script that runs one closed loop at --concurrency
    (``closed_loop_requests``), then --batch1-prompts new prompts of the same lengths one
    at a time (``batch1_requests``)."""
    ap.add_argument("--prompt-len", type=int, default=prompt_len)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=num_prompts,
                    help="requests of the closed loop")
    ap.add_argument("--batch1-prompts", type=int, default=4,
                    help="prompts then run one at a time, each new to the server (its TTFT "
                         "is a cold prefill, never a prefix-cache hit)")


def closed_loop_requests(args: Any) -> list[datasets.BenchRequest]:
    """The requests ``add_closed_loop_flags`` describes (seed 0)."""
    return datasets.synthetic(args.num_prompts, datasets.LengthDist.parse(args.prompt_len),
                              datasets.LengthDist.parse(args.output_len), seed=0)


def batch1_requests(args: Any) -> list[datasets.BenchRequest]:
    """The --batch1-prompts requests run one at a time after the closed loop: prompts of
    its lengths that it never sent (seed 1), so a server's prefix cache cannot serve them
    and TTFT measures a cold prefill (they were the loop's first prompts, all cache hits)."""
    return datasets.synthetic(args.batch1_prompts, datasets.LengthDist.parse(args.prompt_len),
                              datasets.LengthDist.parse(args.output_len), seed=1)


def shared_prefix_requests(args: Any) -> list[datasets.BenchRequest]:
    """--num-prompts requests in --groups groups that share a prefix of --prefix-len tokens,
    each with its own --suffix-len tokens, asking for --output-len tokens. Groups arrive in
    a seeded random order: in group order with an even number of groups, round_robin would
    pin each group to one worker by accident."""
    reqs = datasets.synthetic(args.num_prompts, datasets.LengthDist.parse(args.suffix_len),
                              datasets.LengthDist.parse(args.output_len), seed=0,
                              prefix_groups=args.groups, prefix_len=args.prefix_len)
    random.Random(1).shuffle(reqs)
    return reqs


def warmup_requests() -> list[datasets.BenchRequest]:
    """Two short requests that warm a server up before a measured run."""
    return datasets.synthetic(2, datasets.LengthDist.parse("64"), datasets.LengthDist.parse("4"),
                              seed=99)
