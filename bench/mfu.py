"""Model FLOPs utilisation of decode: the engine in-process (engine.LLMEngine) at batch 64,
against this machine's matmul peak measured in the same run.

* Peak: the best of torch.matmul on large square GEMMs (1024..4096) in bf16 and in
  fp32, --threads threads.
* Achieved: decode tokens/s (steps after every request has its first token) times
  FLOPs per token = 2 x (weights of every matmul: q/k/v/o, gate/up/down, lm_head) +
  attention 4 x layers x context x (heads x head_dim) (QK^T and PV).
* Also the same GEMMs as one decode step at M=64 rows alone (what the shapes allow).

Target: MFU >= 25% of the bf16 peak.

    .venv/bin/python bench/mfu.py [--batch 64] [--prompt-len 128] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.quant.linear import QuantLinear  # noqa: E402
from core.sampling import SamplingParams  # noqa: E402
from tandem.bench.datasets import LengthDist, synthetic  # noqa: E402
from tandem.bench.report import target_line  # noqa: E402
from tandem.bench.script import BenchRun  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402


def gemm_flops(dtype: torch.dtype, sizes=(1024, 2048, 4096), budget_s: float = 2.0
               ) -> dict[int, float]:
    """Best FLOP/s of an n x n x n matmul per size: two warm-up calls (oneDNN/AMX set-up),
    then repeats for budget_s seconds (at least 3), best one kept."""
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.matmul(a, b)
        torch.matmul(a, b)
        times, t_end = [], time.perf_counter() + budget_s
        while len(times) < 3 or time.perf_counter() < t_end:
            times.append(_timed(lambda: torch.matmul(a, b)))
        out[n] = 2 * n ** 3 / min(times)
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every weight matmul: nn.Linear, or QuantLinear (packed + dense) when quantized."""
    return [mod for mod in model.modules() if isinstance(mod, (torch.nn.Linear, QuantLinear))]


def step_gemms_flops(model: torch.nn.Module, m: int, dtype: torch.dtype, reps: int = 5) -> float:
    """FLOP/s of the decode step's weight GEMMs alone: x[m, in] @ W^T for every linear,
    through the kernel the engine picks at m rows."""
    lins = linears(model)
    xs = [torch.randn(m, lin.in_features, dtype=dtype) for lin in lins]
    flops = sum(2 * m * lin.weight.numel() for lin in lins)

    def run() -> None:
        with torch.inference_mode():
            for x, lin in zip(xs, lins):
                lin(x)

    run()
    return flops / min(_timed(run) for _ in range(reps))


def decode_run(eng: LLMEngine, prompts: list[str], prompt_len: int, new_tokens: int) -> dict:
    """Run the batch; time the steps after every request has its first token and count the
    attention context of every token they produce."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts]
    produced = {i: 0 for i in ids}
    steps: list[float] = []
    tokens, context = 0, 0
    while eng.has_unfinished():
        all_started = all(produced.values())
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        for o in outs:
            if all_started:
                # the step's input token sat at position prompt_len + produced - 1 and
                # attended over prompt_len + produced keys
                context += prompt_len + produced[o.request_id]
                tokens += len(o.new_token_ids)
            produced[o.request_id] += len(o.new_token_ids)
        if all_started:
            steps.append(dt)
    return {"tokens": tokens, "seconds": sum(steps), "steps": steps, "context": context}


def profile_steps(eng: LLMEngine, prompts: list[str], batch: int, steps: int = 10,
                  rows: int = 12) -> str:
    """torch.profiler over `steps` decode steps at `batch`: the ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts[:batch]]
    while any(len(eng.requests[i].output_token_ids) == 0 for i in ids):
        eng.step()  # prefill everything first: profile decode steps only
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    wall = (time.perf_counter() - t0) / steps
    while eng.has_unfinished():
        eng.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows,
                                      max_name_column_width=48)
    return f"batch {batch}: {steps} decode steps, {wall * 1e3:.1f} ms/step under the profiler\n{table}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quantization", default="auto", help="engine --quantization (default: auto)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="compiled decode steps (default: on)")
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler op tables of decode steps at batch 1 and "
                         "--batch (after the measurement)")
    args = ap.parse_args()
    bench = BenchRun("mfu")
    torch.set_num_threads(args.threads)

    t_load = time.perf_counter()
    eng = LLMEngine(EngineConfig.from_flat(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                           max_num_seqs=max(64, args.batch), max_model_len=2048,
                                           quantization=args.quantization, compile=args.compile))
    print(f"engine start-up {time.perf_counter() - t_load:.1f}s (quantization "
          f"{args.quantization}, compile {args.compile})", flush=True)
    cfg, model, dtype = eng.model_config, eng.runner.model, eng.runner.dtype
    linear_params = sum(m.weight.numel() for m in linears(model))
    attn_per_ctx = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # FLOPs per key attended
    prompts = [r.prompt for r in synthetic(args.batch, LengthDist.parse(args.prompt_len),
                                           LengthDist.parse(1), seed=5)]
    decode_run(eng, prompts[:4], args.prompt_len, 8)  # warm-up
    run = decode_run(eng, prompts, args.prompt_len, args.new_tokens)
    eng.leak_check()
    flops = 2 * linear_params * run["tokens"] + attn_per_ctx * run["context"]
    tok_s = run["tokens"] / run["seconds"]
    p50_tok_s = args.batch / statistics.median(run["steps"])
    achieved = flops / run["seconds"]
    shape_peak = step_gemms_flops(model, args.batch, dtype)
    profiles = [profile_steps(eng, prompts, b) for b in (1, args.batch)] if args.profile else []
    del eng

    peaks = {name: gemm_flops(dt) for name, dt in (("bfloat16", torch.bfloat16),
                                                   ("float32", torch.float32))}
    best = {name: max(p.values()) for name, p in peaks.items()}
    print(f"\nmodel {Path(args.model).name}: {linear_params / 1e6:.1f}M matmul weights, "
          f"{cfg.num_layers} layers, {cfg.num_heads}x{cfg.head_dim} attention; engine dtype "
          f"{str(dtype).removeprefix('torch.')}, {args.threads} threads")
    print(f"FLOPs/token: 2 x {linear_params / 1e6:.1f}M weights = {2 * linear_params / 1e6:.0f} "
          f"MFLOP + attention {attn_per_ctx / 1e3:.1f} kFLOP x context "
          f"(mean context {run['context'] / run['tokens']:.0f} -> "
          f"{attn_per_ctx * run['context'] / run['tokens'] / 1e6:.1f} MFLOP)")
    print("\nmatmul peak (n x n x n, best over 2 s of repeats per size):")
    for name, p in peaks.items():
        print(f"  {name:9s} " + "  ".join(f"n={n}: {f / 1e9:7.1f} GFLOP/s" for n, f in p.items()))
    print(f"\ndecode at batch {args.batch} (prompt {args.prompt_len}, {args.new_tokens} new tokens):"
          f" {run['tokens']} tokens in {run['seconds']:.2f}s = {tok_s:.1f} tok/s "
          f"(median step: {p50_tok_s:.1f} tok/s)")
    print(f"  achieved {achieved / 1e9:.1f} GFLOP/s")
    print(f"  the step's weight GEMMs alone at M={args.batch} ({str(dtype).removeprefix('torch.')})"
          f": {shape_peak / 1e9:.1f} GFLOP/s = {shape_peak / best['bfloat16']:.1%} of bf16 peak")
    for name in ("bfloat16", "float32"):
        print(f"  MFU vs {name} peak ({best[name] / 1e9:.1f} GFLOP/s): {achieved / best[name]:.1%}")
    print("  " + target_line("MFU vs bf16 peak", 100 * achieved / best["bfloat16"], ">=", 25.0,
                             unit="%"))
    for table in profiles:
        print("\ntorch.profiler, " + table)
    bench.end()


if __name__ == "__main__":
    main()
