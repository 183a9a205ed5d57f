"""Tandem (tandem up --mode colocated, over HTTP) vs Hugging Face transformers
``generate`` at batch 1, sequential, on the same prompts and output lengths.

Tandem: a closed loop of --concurrency clients (throughput), then one client
(batch-1 TPOT), through the shared bench client (tandem/bench). HF: each prompt
through ``model.generate`` one at a time, in fp32 and in Tandem's dtype; the faster
HF dtype is the baseline. TPOT on both sides is (e2e - TTFT) / (tokens - 1).
Targets: c32 throughput >= 15x HF sequential (the benchmarks issue; the engine's
in-process target in bench/bench_engine.py is 10x), batch-1 TPOT <= 1.0x HF.

    .venv/bin/python bench/vs_hf.py [--concurrency 32] [--output-len 64]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from engine.config import dtype_name, resolve_dtype  # noqa: E402
from tandem.bench import datasets, load, report, stats  # noqa: E402
from tandem.bench.client import Endpoint  # noqa: E402
from tandem.bench.hf_baseline import generate_timed, load_hf  # noqa: E402
from tandem.bench.script import (BenchRun, add_closed_loop_flags, batch1_requests,  # noqa: E402
                                  closed_loop_requests)
from tandem.bench.servers import tandem_up  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402


def hf_sequential(model, prompts: list[list[int]], new_tokens: int) -> dict:
    """Batch-1 generate per prompt: tokens/s over the whole sequence, TTFT and TPOT."""
    runs = generate_timed(model, prompts, new_tokens)
    tokens, wall = sum(r.new_tokens for r in runs), sum(r.t1 - r.t0 for r in runs)
    return {"tok_s": tokens / wall, "ttft": statistics.median(r.ttft for r in runs),
            "tpot": statistics.median(r.decode_s / (r.new_tokens - 1) for r in runs),
            "tokens": tokens, "wall": wall}


def run_tandem(args, reqs: list[datasets.BenchRequest]) -> tuple[stats.Summary, stats.Summary, list]:
    with tandem_up("--mode", "colocated", "--dtype", args.dtype, model=args.model) as srv:
        ep = Endpoint(srv.url, Path(args.model).name.removesuffix(".gguf"))
        load.run(ep, reqs[:4], concurrency=4, progress=False)  # warm-up
        c = load.run(ep, reqs, concurrency=args.concurrency, label=f"tandem c{args.concurrency}")
        b1 = load.run(ep, batch1_requests(args), concurrency=1, label="tandem c1")
    return (stats.summarize(c.results, c.duration_s), stats.summarize(b1.results, b1.duration_s),
            [(c.label, c.results), (b1.label, b1.results)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--dtype", default="auto", help="Tandem's dtype (HF runs fp32 and this)")
    add_closed_loop_flags(ap, prompt_len=32, num_prompts=96)  # batch 1: Tandem c1 and each HF dtype
    ap.add_argument("--plot", default=None, help="PNG of the Tandem latency CDFs")
    args = ap.parse_args()
    bench = BenchRun("vs_hf")
    reqs = closed_loop_requests(args)
    conc, b1, timelines = run_tandem(args, reqs)

    from core.tokenizer import Tokenizer

    tok = Tokenizer.load(args.model)
    hf_prompts = [tok.encode(r.prompt) for r in batch1_requests(args)]
    eng_dtype = dtype_name(resolve_dtype(args.dtype))
    hf32 = load_hf(Path(args.model))
    hf_sets = [("float32", hf32)]
    if eng_dtype != "float32":
        hf_sets.append((eng_dtype, copy.deepcopy(hf32).to(resolve_dtype(eng_dtype))))
    hf = {}
    for name, model in hf_sets:
        hf_sequential(model, hf_prompts[:1], 8)  # warm-up
        hf[name] = hf_sequential(model, hf_prompts, args.output_len)
        print(f"  HF {name}: done", flush=True)
    best = max(hf, key=lambda k: hf[k]["tok_s"])

    print(f"\n{args.prompt_len}-token prompts, {args.output_len} output tokens (ignore_eos), "
          f"greedy; Tandem colocated ({eng_dtype}, 2 threads) over HTTP")
    print(report.format_table([(f"tandem c{args.concurrency}", conc), ("tandem c1", b1)]))
    print(f"\n{'HF generate (batch 1, sequential)':34s} {'tok/s':>8s} {'TTFT ms':>8s} {'TPOT ms':>8s}")
    for name, r in hf.items():
        print(f"  {name:32s} {r['tok_s']:8.1f} {r['ttft'] * 1e3:8.1f} {r['tpot'] * 1e3:8.2f}")
    print(f"\nbaseline: HF {best} (the faster HF dtype here)")
    thr = conc.output_throughput / hf[best]["tok_s"]
    tpot = b1.tpot.p50 / hf[best]["tpot"]
    print(f"  Tandem c{args.concurrency} {conc.output_throughput:.1f} tok/s vs HF sequential "
          f"{hf[best]['tok_s']:.1f} tok/s")
    print("  " + report.target_line(f"throughput ratio Tandem c{args.concurrency} / HF sequential",
                                    thr, ">=", 15.0))
    print(f"  Tandem c1 TPOT p50 {b1.tpot.p50 * 1e3:.2f} ms vs HF {hf[best]['tpot'] * 1e3:.2f} ms")
    print("  " + report.target_line("batch-1 TPOT ratio Tandem / HF", tpot, "<=", 1.0))
    if args.plot:
        report.plot_cdfs(args.plot, timelines, "Tandem colocated: c32 vs c1")
    bench.end()


if __name__ == "__main__":
    main()
