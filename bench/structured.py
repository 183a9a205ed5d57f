"""What constrained decoding costs, on one box: grammar compile time, mask time per
token, and decode TPOT with and without constraints at batch 1 and 32.

- compile: each schema of tests/guided_cases.py (23 of the listed kinds) compiled cold
  by a fresh GrammarCompiler (llguidance's tokenizer built once first, timed apart),
  and the shortest-output search the max_tokens check runs;
- mask per token: llguidance alone (a fresh matcher replaying recorded outputs, one
  compute per token), and inside the engine: the mask thread's time per step (all of
  a step's constrained rows at once, llguidance's executor plus unpacking) and how
  long the engine thread waited for it after its forward (the part not hidden);
- TPOT: the median decode step while every request of the batch is decoding, free
  text (ignore_eos) against a JSON schema whose outputs outrun max_tokens (an object
  with a title, 3-6 tags and a 300+ character summary), runs interleaved and repeated;
  the target is <= 5% more at batch 32. Each run's TPOT is the median of its steps;
  the best of the runs is the figure least disturbed by other load on the box.

    python bench/structured.py [--model PATH] [--dtype auto|float32|bfloat16] [--quick]
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from engine.config import EngineConfig  # noqa: E402
from core.guided.compiler import GrammarCompiler  # noqa: E402
from core.guided.spec import GuidedSpec  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from core.sampling import SamplingParams  # noqa: E402
from tests.guided_cases import SCHEMAS  # noqa: E402

DEFAULT_MODEL = os.environ.get("TANDEM_MODEL",
                               "/root/.cache/tandem/SmolLM2-135M-Instruct.Q4_1.gguf")
REPORT = {"type": "object", "additionalProperties": False,
          "required": ["title", "tags", "summary"],
          "properties": {"title": {"type": "string", "maxLength": 40},
                         "tags": {"type": "array", "minItems": 3, "maxItems": 6,
                                  "items": {"type": "string", "maxLength": 12}},
                         "summary": {"type": "string", "minLength": 300}}}


def ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return f"mean {1e3 * statistics.fmean(xs):7.3f} ms  p99 {1e3 * p99:7.3f} ms  (n={len(xs)})"


def bench_compile(eng: LLMEngine) -> None:
    fresh = GrammarCompiler(eng.tokenizer, eng.model_config.vocab_size)
    t0 = time.perf_counter()
    fresh.ll_tokenizer
    print(f"llguidance tokenizer from ours: {1e3 * (time.perf_counter() - t0):.0f} ms (once per "
          "process)")
    compile_s, search_s = [], []
    for schema in [*SCHEMAS.values(), REPORT]:
        spec = GuidedSpec.json_schema(schema)
        t0 = time.perf_counter()
        fresh.start(spec)
        t1 = time.perf_counter()
        fresh.min_tokens(spec)
        compile_s.append(t1 - t0)
        search_s.append(time.perf_counter() - t1)
    print(f"grammar compile, {len(compile_s)} schemas:      {ms(compile_s)}  max "
          f"{1e3 * max(compile_s):.2f} ms")
    print(f"shortest-output search (max_tokens check): {ms(search_s)}  max "
          f"{1e3 * max(search_s):.2f} ms")


def decode(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams
           ) -> tuple[list[float], list[list[int]]]:
    """Step times while every request decodes (all past their first token, none done)."""
    ids = [eng.add_request(p, params) for p in prompts]
    reqs = [eng.requests[i] for i in ids]
    steps = []
    while eng.has_unfinished():
        full = all(r.num_output_tokens >= 1 and not r.finished for r in reqs)
        t0 = time.perf_counter()
        eng.step()
        if full and all(not r.finished for r in reqs):
            steps.append(time.perf_counter() - t0)
    return steps, [r.output_token_ids for r in reqs]


def mask_replay(eng: LLMEngine, outputs: list[list[int]]) -> list[float]:
    """llguidance alone: one mask per token of recorded constrained outputs."""
    times = []
    for out in outputs:
        state = eng.guided.start(GuidedSpec.json_schema(REPORT))
        for t in out:
            t0 = time.perf_counter()
            state.matcher.compute_bitmask()
            times.append(time.perf_counter() - t0)
            state.consume(t)
    return times


def bench_tpot(eng: LLMEngine, batch: int, new_tokens: int, repeats: int) -> None:
    rng = random.Random(batch)
    free = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(max_tokens=new_tokens, temperature=0.0,
                            guided=GuidedSpec.json_schema(REPORT))
    runs: dict[str, list[float]] = {"free": [], "guided": []}
    stats = eng.runner.masks.stats
    for q in (stats.build_seconds, stats.wait_seconds, stats.rows):
        q.clear()
    outputs: list[list[int]] = []
    for _ in range(repeats):
        for name, params in (("free", free), ("guided", guided)):
            prompts = [[rng.randrange(100, 30000) for _ in range(32)] for _ in range(batch)]
            steps, outs = decode(eng, prompts, params)
            runs[name].append(statistics.median(steps))
            if name == "guided":
                outputs += outs
    print(f"\nbatch {batch}, {repeats} interleaved runs of {new_tokens} tokens, each run's "
          f"median step: free {[round(1e3 * x, 1) for x in runs['free']]} ms, constrained "
          f"{[round(1e3 * x, 1) for x in runs['guided']]} ms")
    for label, pick in (("best run", min), ("median run", statistics.median)):
        u, c = pick(runs["free"]), pick(runs["guided"])
        print(f"  TPOT ({label:10s}): free {1e3 * u:7.2f} ms, constrained {1e3 * c:7.2f} ms, "
              f"overhead {100 * (c / u - 1):+5.1f}%")
    rows = max(stats.rows) if stats.rows else 0
    print(f"  mask thread per step ({rows} rows):   {ms(list(stats.build_seconds))}")
    if rows > 1:
        per_row = [s / n for s, n in zip(stats.build_seconds, stats.rows)]
        print(f"  mask thread per token (step / rows): {ms(per_row)}")
    print(f"  engine thread waiting for masks:     {ms(list(stats.wait_seconds))}")
    print(f"  llguidance alone, per token:         {ms(mask_replay(eng, outputs[:4]))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file or HF directory")
    ap.add_argument("--dtype", default="auto", help="engine dtype: auto, float32, bfloat16")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats (smoke run)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: torch's default, every core); fewer leave a core "
                         "to the mask thread, as a GPU server's forward does")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    new_tokens, repeats = (40, 1) if args.quick else (64, 5)
    load1 = os.getloadavg()[0]
    if load1 > (os.cpu_count() or 1) * 0.5:
        print(f"WARNING: load average {load1:.1f} on {os.cpu_count()} CPUs before start: "
              "other processes compete for the cores.", flush=True)
    eng = LLMEngine(EngineConfig.from_flat(model=args.model, dtype=args.dtype, max_model_len=2048,
                                           num_threads=args.threads or None))
    print(f"model {Path(args.model).name}  dtype {eng.runner.dtype}  torch threads "
          f"{torch.get_num_threads()}  CPUs {os.cpu_count()}", flush=True)
    bench_compile(eng)
    decode(eng, [[5] * 16, [6] * 16], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    for batch in (1, 32):
        bench_tpot(eng, batch, new_tokens, repeats)
    eng.leak_check()
    print(f"\nload average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
