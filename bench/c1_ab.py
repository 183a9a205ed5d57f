"""Batch-1 decode TPOT of two engine set-ups in one process, interleaved round by round, so
the host's drift (10-30% between runs here) falls out of the ratio.

Each round sends one new prompt to engine A, then to engine B, for --tokens + 1 tokens;
TPOT is the time of the steps after its first token, over --tokens. Printed: each
round's TPOT of A and B, their ratio B/A and whether the greedy tokens agree, then the
medians. A setting is an engine flag as ``EngineConfig.from_flat`` takes it
(``activation_quant=int8``), or ``inductor.NAME=VALUE`` for an inductor config option
set while that engine is built and run
(``inductor.cpp_wrapper=True``). Inductor's options are not among dynamo's guards, but
each engine's batch-1 decode step is its own one-graph step (a code copy per model,
engine/compile/decode.py), compiled while that engine is built under its own options:
that is the step timed here. (Clearing dynamo's cache between the two builds, as this
script once did, dropped engine A's one-graph step: its next run was a recompile, which
a one-graph step refuses, so A fell back to per-layer steps and B/A read 0.5.) The two
engines' prefill steps may share one compiled graph; they are not timed.

    python bench/c1_ab.py --b activation_quant=int8
    python bench/c1_ab.py --b inductor.cpp_wrapper=True
    python bench/c1_ab.py --a compile=False --b compile=True --rounds 6
    python bench/c1_ab.py --both dtype=float32 --b quantization=none
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from core.sampling import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from bench.c32_steps import flag_value  # noqa: E402
from engine.native import simd_flags  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402

BASE = dict(compile=True, compile_max_batch=1, max_num_seqs=1, num_kv_blocks=256,
            max_model_len=1024, max_num_batched_tokens=256)
"""Both engines' flags before --a / --b: one sequence, the batch-1 bucket compiled."""


def settings(items: list[str]) -> tuple[dict, dict]:
    """KEY=VALUE items -> (engine flags, inductor options)."""
    engine, inductor = {}, {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{Path(sys.argv[0]).stem}: '{item}' is not KEY=VALUE")
        if key.startswith("inductor."):
            inductor[key.removeprefix("inductor.")] = flag_value(value)
        else:
            engine[key] = flag_value(value)
    return engine, inductor


@contextlib.contextmanager
def inductor_options(options: dict) -> Iterator[None]:
    if not options:
        yield
        return
    import torch._inductor.config as ic
    with ic.patch(options):
        yield


def build(model: str, engine: dict, inductor: dict) -> LLMEngine:
    with inductor_options(inductor):  # the compile happens while the engine is built
        return LLMEngine(EngineConfig.from_flat(model=model, **{**BASE, **engine}))


def tpot(eng: LLMEngine, inductor: dict, prompt: list[int], tokens: int
         ) -> tuple[float, list[int]]:
    """ms per decode step for ``tokens`` tokens after the prompt's first one, and the
    tokens. The steps are timed themselves, from the first token to the last: the prefill
    is never in the window. (This once subtracted a 1-token request's time from a
    (tokens + 1)-token one's. With the prefix cache on, the second request found the
    first one's prompt cached and prefilled only its tail, so the difference left out
    (prefill - cached prefill) / tokens, about 2.7 ms a token for 128-token prompts here:
    11.2-12.2 ms read where the steps took 13.2-14.5.)"""
    with inductor_options(inductor):
        rid = eng.add_request(prompt, SamplingParams(max_tokens=tokens + 1, temperature=0.0,
                                                     ignore_eos=True))
        req = eng.requests[rid]
        while req.num_output_tokens == 0 and eng.has_unfinished():  # the prefill
            eng.step()
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        t1 = time.perf_counter()
    return (t1 - t0) / tokens * 1e3, req.output_token_ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--a", nargs="*", default=[], metavar="KEY=VALUE", help="engine A's settings")
    ap.add_argument("--b", nargs="*", default=[], metavar="KEY=VALUE", help="engine B's settings")
    ap.add_argument("--both", nargs="*", default=[], metavar="KEY=VALUE",
                    help="settings of both engines, before --a / --b")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens timed per round")
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    print(f"SIMD flags: {' '.join(simd_flags())}; both: {' '.join(args.both) or 'defaults'}; "
          f"A: {' '.join(args.a) or 'defaults'}; B: {' '.join(args.b) or 'defaults'}", flush=True)
    sa, sb = settings(args.both + args.a), settings(args.both + args.b)  # refused before a load
    a, b = build(args.model, *sa), build(args.model, *sb)
    vocab = a.runner.model.cfg.vocab_size

    def prompt(r: int) -> list[int]:  # new to both engines each round: no prefix hit
        return [(7 * r + 13 * j) % (vocab - 10) + 10 for j in range(args.prompt_len)]

    for eng, s in ((a, sa), (b, sb)):  # warm-up
        tpot(eng, s[1], prompt(args.rounds), min(args.tokens, 8))
    ta, tb, same = [], [], 0
    for r in range(args.rounds):
        (x, ids_a), (y, ids_b) = (tpot(a, sa[1], prompt(r), args.tokens),
                                  tpot(b, sb[1], prompt(r), args.tokens))
        ta.append(x)
        tb.append(y)
        same += ids_a == ids_b
        print(f"round {r}: A {x:.2f} ms, B {y:.2f} ms, B/A {y / x:.3f}, "
              f"tokens {'equal' if ids_a == ids_b else 'differ'}", flush=True)
    print(f"medians: A {statistics.median(ta):.2f} ms, B {statistics.median(tb):.2f} ms, "
          f"B/A {statistics.median(y / x for x, y in zip(ta, tb)):.3f}; "
          f"tokens equal in {same} of {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
