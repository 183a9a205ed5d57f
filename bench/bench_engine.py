"""Engine throughput on one CPU box, against Hugging Face transformers at batch 1.

Prints one table: decode tokens/s at batch 1, 8 and 32, prefill tokens/s for
512-token prompts, HF ``generate`` at batch 1 (sequential) in fp32 and in the
engine's dtype, and the two ratios we track (batch-32 aggregate / HF batch-1,
our batch-1 / HF batch-1) against the best HF dtype.

"decode tok/s" is measured the same way on both sides: tokens generated after
each request's first token, over the time from when *every* request of the
batch had its first token to when the last one finished (prefill excluded).
"e2e tok/s" is all generated tokens over the whole wall time.

    python bench/bench_engine.py [--model PATH] [--dtype auto|float32|bfloat16] [--quick]
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from engine.config import EngineConfig, dtype_name, resolve_dtype  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from core.sampling import SamplingParams  # noqa: E402
from tandem.bench.hf_baseline import generate_timed, load_hf  # noqa: E402

DEFAULT_MODEL = os.environ.get("TANDEM_MODEL", "/root/.cache/tandem/SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass
class Result:
    name: str
    batch: int
    prompt_len: int
    new_tokens: int
    decode_tps: float | None  # decode-only tokens/s, aggregate over the batch
    e2e_tps: float  # generated (or prefilled) tokens over total wall time
    wall_s: float
    p50_step_ms: float | None = None  # median decode step (robust to other load on the box)

    @property
    def p50_tps(self) -> float | None:
        return None if not self.p50_step_ms else self.batch * 1000.0 / self.p50_step_ms


class PromptMaker:
    """Distinct random-token prompts, so the prefix cache never shortens a measurement."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.hi = min(vocab_size, 32000)

    def make(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(100, self.hi) for _ in range(length)] for _ in range(n)]


def bench_engine_decode(eng: LLMEngine, prompts: list[list[int]], new_tokens: int, name: str) -> Result:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts]
    waiting_first = set(ids)
    generated = 0
    t0 = time.perf_counter()
    t_all_first: float | None = None
    generated_at_first = 0
    steps: list[float] = []  # durations of the steps after every request had its first token
    while eng.has_unfinished():
        ts = time.perf_counter()
        for out in eng.step():
            generated += len(out.new_token_ids)
            if out.request_id in waiting_first and out.new_token_ids:
                waiting_first.discard(out.request_id)
        if t_all_first is not None:
            steps.append(time.perf_counter() - ts)
        elif not waiting_first:
            t_all_first = time.perf_counter()
            generated_at_first = generated
    t1 = time.perf_counter()
    decode_tokens = generated - generated_at_first
    decode = decode_tokens / (t1 - t_all_first) if t_all_first and t1 > t_all_first else None
    p50 = statistics.median(steps) * 1000 if steps else None
    return Result(name, len(prompts), len(prompts[0]), new_tokens, decode, generated / (t1 - t0),
                  t1 - t0, p50)


def bench_engine_prefill(eng: LLMEngine, prompts: list[list[int]]) -> Result:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    before = eng.num_computed_tokens_total
    t0 = time.perf_counter()
    eng.generate(prompts, params)
    wall = time.perf_counter() - t0
    computed = eng.num_computed_tokens_total - before
    return Result("engine prefill", len(prompts), len(prompts[0]), 1, None, computed / wall, wall)


def bench_hf(model, prompts: list[list[int]], new_tokens: int, name: str) -> Result:
    """HF generate, one prompt at a time; decode/e2e summed over the prompts."""
    runs = generate_timed(model, prompts, new_tokens)
    decode_tokens = sum(r.new_tokens - 1 for r in runs)
    total_tokens, total_s = sum(r.new_tokens for r in runs), sum(r.t1 - r.t0 for r in runs)
    steps = [b - a for r in runs for a, b in zip(r.stamps, r.stamps[1:])]
    return Result(name, 1, len(prompts[0]), new_tokens,
                  decode_tokens / sum(r.decode_s for r in runs), total_tokens / total_s,
                  total_s, statistics.median(steps) * 1000)


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file or HF directory")
    ap.add_argument("--dtype", default="auto", help="engine dtype: auto, float32, bfloat16")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and HF prompts (smoke run)")
    ap.add_argument("--quantization", default="auto", help="engine --quantization (default: auto)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="compiled decode steps (default: on)")
    ap.add_argument("--skip-hf", action="store_true", help="no HF baseline (engine rows only)")
    ap.add_argument("--skip-fp32", action="store_true", help="no float32 engine rows")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    new_tokens = 32 if args.quick else 64
    hf_prompts = 1 if args.quick else 2
    prefill_batch = 2 if args.quick else 4
    prompt_len, prefill_len = 32, 512
    model_path = Path(args.model)
    t_start = time.perf_counter()
    load1 = os.getloadavg()[0]
    if load1 > (os.cpu_count() or 1) * 0.5:
        print(f"WARNING: load average {load1:.1f} on {os.cpu_count()} CPUs before start: other "
              "processes compete for the cores; trust the p50 columns over the means.", flush=True)

    t_load = time.perf_counter()
    eng = LLMEngine(EngineConfig.from_flat(model=str(model_path), dtype=args.dtype, max_model_len=2048,
                                           quantization=args.quantization, compile=args.compile))
    print(f"engine start-up {time.perf_counter() - t_load:.1f}s (quantization "
          f"{args.quantization}, compile {args.compile})", flush=True)
    eng_dtype = dtype_name(resolve_dtype(args.dtype))
    maker = PromptMaker(eng.model_config.vocab_size)
    print(f"model {model_path.name}  engine dtype {eng_dtype}  torch threads {torch.get_num_threads()}  "
          f"attention {eng.runner.backend.name}", flush=True)

    bench_engine_decode(eng, maker.make(2, prompt_len), 8, "warmup")  # first-call overheads
    results = []
    for batch in (1, 8, 32):
        results.append(bench_engine_decode(eng, maker.make(batch, prompt_len), new_tokens,
                                           f"engine decode ({eng_dtype})"))
        print(f"  engine batch {batch}: done", flush=True)
    results.append(bench_engine_prefill(eng, maker.make(prefill_batch, prefill_len)))
    results[-1].name = f"engine prefill ({eng_dtype})"
    eng.leak_check()
    del eng
    if eng_dtype != "float32" and not args.skip_fp32:  # is `auto` right for this CPU? fp32 too
        eng = LLMEngine(EngineConfig.from_flat(model=str(model_path), dtype="float32", max_model_len=2048,
                                               quantization=args.quantization, compile=args.compile))
        bench_engine_decode(eng, maker.make(2, prompt_len), 8, "warmup")
        for batch in (1, 32):
            results.append(bench_engine_decode(eng, maker.make(batch, prompt_len), new_tokens,
                                               "engine decode (float32)"))
        print("  engine float32: done", flush=True)
        eng.leak_check()
        del eng

    hf_sets = []
    if not args.skip_hf:
        hf32 = load_hf(model_path)
        hf_sets = [("float32", hf32)]
        if eng_dtype != "float32":
            hf_sets.append((eng_dtype, copy.deepcopy(hf32).to(resolve_dtype(eng_dtype))))
    hf_prompt_ids = maker.make(hf_prompts, prompt_len)
    hf_results = []
    for name, model in hf_sets:
        bench_hf(model, maker.make(1, prompt_len), 8, "warmup")
        hf_results.append(bench_hf(model, hf_prompt_ids, new_tokens, f"HF generate ({name})"))
        print(f"  HF {name}: done", flush=True)
    results += hf_results

    print("\ndecode tok/s: tokens after each request's first token / time from the moment every "
          "request had its first token to the end (prefill excluded), summed over the batch.\n"
          "p50 tok/s: batch / median decode step time (the same, robust to other load on the box).\n"
          "e2e tok/s: all generated tokens / total wall time (prefill rows: prompt tokens / wall).\n")
    head = (f"{'run':28s} {'batch':>5s} {'prompt':>6s} {'new':>4s} {'decode tok/s':>13s} "
            f"{'p50 step ms':>11s} {'p50 tok/s':>10s} {'e2e tok/s':>10s} {'wall s':>7s}")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r.name:28s} {r.batch:5d} {r.prompt_len:6d} {r.new_tokens:4d} {fmt(r.decode_tps):>13s} "
              f"{fmt(r.p50_step_ms):>11s} {fmt(r.p50_tps):>10s} {fmt(r.e2e_tps):>10s} {r.wall_s:7.2f}")

    ours = {r.batch: r for r in results if r.name == f"engine decode ({eng_dtype})"}
    if not hf_results:
        print(f"\ntotal bench time {time.perf_counter() - t_start:.0f}s")
        return
    best_hf = max(hf_results, key=lambda r: r.p50_tps or 0.0)
    print(f"\nRatios use engine {eng_dtype}. HF baseline: {best_hf.name}, the faster HF dtype on this CPU "
          f"({fmt(best_hf.decode_tps)} decode tok/s, {fmt(best_hf.p50_tps)} p50 tok/s at batch 1)")
    for label, num, target in (("engine batch-32 aggregate / HF batch-1", ours[32], 10.0),
                               ("engine batch-1 / HF batch-1", ours[1], 1.0)):
        r_mean = num.decode_tps / best_hf.decode_tps
        r_p50 = num.p50_tps / best_hf.p50_tps
        verdict = "OK" if min(r_mean, r_p50) >= target else "BELOW TARGET"
        print(f"  {label:39s}: {r_mean:7.2f}x decode, {r_p50:7.2f}x p50  "
              f"(target >= {target:g}x)  {verdict}")
    print(f"\ntotal bench time {time.perf_counter() - t_start:.0f}s; load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
