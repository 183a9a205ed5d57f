"""Where a closed-loop c32 run's time goes, in process (no HTTP): the workload of
bench/vs_peers.py's c32 phase (64 requests of 128 random tokens, 64 output tokens each,
greedy, ignore_eos, 32 in flight: a new one arrives as one ends), step by step.

Prints output tokens/s over the run, then the decode-only steps and the steps that carry a
prefill chunk: their count, total and median time, and the decode-only median by rows.

    python bench/c32_steps.py [--prompt-len 128] [ENGINE_FLAG=VALUE ...]
    python bench/c32_steps.py prepack_weights=False      # against the plain dense GEMMs
    ATEN_CPU_CAPABILITY=avx2 TANDEM_CPU_CAPABILITY=avx2 python bench/c32_steps.py
"""
from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from core.sampling import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.native import simd_flags  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402


def flag_value(text: str):
    """An ENGINE_FLAG=VALUE argument's value: True/False, an int, else the text."""
    return {"True": True, "False": False}.get(text, int(text) if text.isdigit() else text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("flags", nargs="*", metavar="FLAG=VALUE",
                    help="engine flags by their flat names (prepack_weights=False)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    kw = {"model": str(default_model_path()), "max_model_len": 2048}
    kw.update((k, flag_value(v)) for k, _, v in (f.partition("=") for f in args.flags))
    print(f"SIMD flags: {' '.join(simd_flags())}; engine flags: {args.flags or 'defaults'}")
    eng = LLMEngine(EngineConfig.from_flat(**kw))
    rng = random.Random(0)
    vocab = eng.runner.model_config.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)]

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    eng.generate([prompt() for _ in range(4)], SamplingParams(max_tokens=8, temperature=0.0,
                                                               ignore_eos=True))  # warm
    sent = 0
    for _ in range(min(args.concurrency, args.requests)):
        eng.add_request(prompt(), params)
        sent += 1
    steps: list[tuple[float, int, int]] = []  # (ms, tokens computed, outputs)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        before, t = eng.num_computed_tokens_total, time.perf_counter()
        outs = eng.step()
        steps.append(((time.perf_counter() - t) * 1e3, eng.num_computed_tokens_total - before,
                      len(outs)))
        for out in outs:
            if out.finished and sent < args.requests:
                eng.add_request(prompt(), params)
                sent += 1
    wall = time.perf_counter() - t0
    print(f"{args.requests} requests in {wall:.2f} s: "
          f"{args.requests * args.output_len / wall:.1f} output tok/s, {len(steps)} steps")
    decode = [s for s in steps if s[1] == s[2]]
    mixed = [s for s in steps if s[1] != s[2]]
    for name, group in (("decode-only", decode), ("with a prefill chunk", mixed)):
        if group:
            print(f"{name}: {len(group)} steps, {sum(s[0] for s in group) / 1e3:.2f} s, "
                  f"median {statistics.median(s[0] for s in group):.1f} ms "
                  f"({statistics.median(s[1] for s in group):.0f} tokens)")
    by_rows = {r: statistics.median(s[0] for s in decode if s[2] == r)
               for r in sorted({s[2] for s in decode})}
    print("decode-only median ms by rows:",
          " ".join(f"{r}:{ms:.1f}" for r, ms in by_rows.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
