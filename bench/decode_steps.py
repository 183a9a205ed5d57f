"""Decode steps of R rows on several engine set-ups in one process, stepped in turn, so
the host's drift (10-30% between runs here) falls out of the ratios.

Each set-up is an engine built with its own flags (``NAME:FLAG=VALUE,FLAG=VALUE``, the
flags as ``EngineConfig.from_flat`` takes them); every engine gets the same R prompts of
--prompt-len random tokens, prefills them, then the engines take one decode step each in
turn, --steps times. Printed per row count: each set-up's median step, its ratio to the
first set-up's, and whether its greedy tokens equal the first's (in bf16 compiled steps
of different shapes round differently, so they may not; the fp32 tests assert it).

    python bench/decode_steps.py --rows 8,16,32,64
    python bench/decode_steps.py --rows 32 per-layer: groups5:compile_graph_layers=5
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

from bench.c1_ab import settings  # noqa: E402
from core.sampling import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.native import simd_flags  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402

SETUPS = ("per-layer:", "groups10:compile_graph_layers=10", "one-graph:compile_graph_max_batch=64")
"""The default set-ups: today's default, larger steps as graphs of 10 layers, every step
as one graph."""


def setup(item: str) -> tuple[str, dict]:
    """``NAME:FLAG=VALUE,...`` -> (name, engine flags)."""
    name, _, flags = item.partition(":")
    engine, inductor = settings([f for f in flags.split(",") if f])
    if inductor:
        raise SystemExit(f"decode_steps: set-up {name!r}: inductor options "
                         f"({', '.join(inductor)}) are bench/c1_ab.py's")
    return name, engine


def run(model: str, rows: int, setups: list[tuple[str, dict]], steps: int, prompt_len: int
        ) -> list[tuple[str, float, bool]]:
    """-> (name, median step ms, tokens equal the first set-up's) per set-up."""
    engines = {name: LLMEngine(EngineConfig.from_flat(**{
        "model": model, "max_model_len": 2048, **flags})) for name, flags in setups}
    first = next(iter(engines.values()))
    vocab = first.runner.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(prompt_len)] for _ in range(rows)]
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    times = {name: [] for name in engines}
    tokens: dict[str, dict[str, list[int]]] = {name: {} for name in engines}
    for name, eng in engines.items():
        for i, p in enumerate(prompts):
            eng.add_request(p, params, request_id=str(i))
        while eng.num_computed_tokens_total < rows * prompt_len:  # the prefills
            eng.step()
    for _ in range(steps):
        for name, eng in engines.items():
            t = time.perf_counter()
            outs = eng.step()
            times[name].append((time.perf_counter() - t) * 1e3)
            for o in outs:
                tokens[name].setdefault(o.request_id, []).extend(o.new_token_ids)
    base = next(iter(tokens.values()))
    return [(name, statistics.median(times[name]), tokens[name] == base) for name in engines]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("setups", nargs="*", default=list(SETUPS), metavar="NAME:FLAG=VALUE,...")
    ap.add_argument("--rows", default="32", help="comma-separated row counts (default 32)")
    ap.add_argument("--steps", type=int, default=58, help="decode steps per engine")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--model", default=None, help="default: the embedded model")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    setups = [setup(s) for s in args.setups]
    print(f"SIMD flags: {' '.join(simd_flags())}")
    for rows in (int(r) for r in args.rows.split(",")):
        results = run(args.model or str(default_model_path()), rows, setups, args.steps,
                      args.prompt_len)
        base = results[0][1]
        for name, ms, same in results:
            print(f"{rows:3d} rows  {name:12s} median {ms:7.2f} ms  {ms / base:.3f}x  "
                  f"tokens equal {results[0][0]}'s: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
