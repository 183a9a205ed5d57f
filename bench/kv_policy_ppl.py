"""Perplexity under bounded KV policies (issue 31's acceptance; docs/performance.md l).

The embedded model (SmolLM2-135M-Instruct, the Q4_1 GGUF, default dtype and
quantization) reads a fixed text token by token as a prompt with prompt_logprobs: each
prompt token's logprob given everything before it as the policy left it. The text:
CPython's documentation topics (``pydoc_data.topics``, sorted by topic, joined by blank
lines, as bench/quant_quality.py), its first --tokens tokens.

Configs, all as requests of one engine (--allow-request-kv-policy), so their rows share
every step: ``full`` (every token: only up to the model's context window, the longest
request the engine serves; past it full attention is not defined for this model, so
its column stops there), and at each budget: a plain window (streaming with sinks=0),
``streaming`` (sinks=4) and ``h2o`` (heavy = recent = budget / 2, as the paper's
default split). Streaming and window run their prompt in chunks that end where their
kept blocks change, which computes exactly what token-by-token decoding would; h2o runs
one token a step past its budget (each one evicts).

Prints a table of perplexities per span and writes the per-token NLLs (--out, JSON)
and a plot of the NLL averaged over windows of --smooth tokens (--plot, PNG).

    flock /tmp/tandem-cpu.lock nice .venv/bin/python bench/kv_policy_ppl.py \\
        [--tokens 16384] [--budgets 256 512] [--out nll.json] [--plot docs/kv_policy_ppl.png]
    .venv/bin/python bench/kv_policy_ppl.py --replot nll.json --plot docs/kv_policy_ppl.png
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from bench.quant_quality import fixed_text  # noqa: E402
from core.sampling import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402


def configs(budgets: list[int]) -> list[tuple[str, str]]:
    out = [("full", "full")]
    for b in budgets:
        out += [(f"window {b}", f"streaming:sinks=0,window={b}"),
                (f"streaming {b}", f"streaming:sinks=4,window={b - 4}"),
                (f"h2o {b}", f"h2o:heavy={b // 2},recent={b - b // 2}")]
    return out


def run(eng: LLMEngine, ids: list[int], jobs: list[tuple[str, str]]) -> dict[str, list[float]]:
    """Each config's NLL of prompt tokens 1 .. (its prompt's end) - 1, all run together."""
    reqs = {}
    for name, policy in jobs:
        prompt = ids[:eng.max_model_len - 1] if policy == "full" else ids  # room for its 1 token
        rid = eng.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0),
                              kv_policy=policy)
        reqs[name] = eng.requests[rid]
    steps, t0 = 0, time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps % 1000 == 0:
            done = {n: len(r.prompt_logprobs) for n, r in reqs.items()}
            print(f"  step {steps}, {time.perf_counter() - t0:.0f} s: {done}", flush=True)
    return {n: [-lp.logprob for lp in r.prompt_logprobs] for n, r in reqs.items()}


def ppl(nll: list[float], lo: int, hi: int) -> str:
    part = nll[lo:hi]
    return f"{math.exp(sum(part) / len(part)):.2f}" if part and hi <= len(nll) else "-"


def table(nll: dict[str, list[float]], ctx: int, n: int) -> str:
    """Perplexity per span of predicted tokens (token i + 1 given tokens 0 .. i)."""
    cuts = sorted({0, 256, 1024, ctx - 1, n - 1} & set(range(n)))
    spans = [(lo, hi) for lo, hi in zip(cuts, cuts[1:])] + [(0, n - 1)]
    head = " | ".join(f"tokens {lo + 1}-{hi}" for lo, hi in spans)
    rows = [f"| config | {head} |", "|---" * (len(spans) + 1) + "|"]
    for name, v in nll.items():
        rows.append(f"| {name} | " + " | ".join(ppl(v, lo, hi) for lo, hi in spans) + " |")
    return "\n".join(rows)


def plot(nll: dict[str, list[float]], smooth: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, v in nll.items():
        xs = list(range(smooth, len(v) + 1, smooth))
        ax.plot(xs, [sum(v[x - smooth:x]) / smooth for x in xs], label=name,
                ls="-" if name == "full" else "--" if "window" in name else "-", lw=1.2)
    ax.set_xlabel("tokens read")
    ax.set_ylabel(f"NLL per token (mean over {smooth} tokens)")
    ax.set_title("SmolLM2-135M on pydoc topics: bounded KV policies")
    ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--smooth", type=int, default=256)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--replot", type=Path, help="plot and tabulate a saved --out; run nothing")
    args = ap.parse_args()
    if args.replot:
        nll = json.loads(args.replot.read_text())
        n = max(len(v) for v in nll.values()) + 1
        print(table(nll, min(len(nll["full"]) + 1, n), n))
        if args.plot:
            plot(nll, args.smooth, args.plot)
        return
    eng = LLMEngine(EngineConfig.from_flat(
        model=str(default_model_path()), allow_request_kv_policy=True, num_threads=2,
        enable_prefix_caching=False, max_stream_len=args.tokens + 1))
    ids = eng.tokenizer.encode(fixed_text())[:args.tokens]
    print(f"{len(ids)} tokens; context window {eng.max_model_len}; {eng.runner.dtype}")
    t0 = time.perf_counter()
    nll = run(eng, ids, configs(args.budgets))
    print(f"{time.perf_counter() - t0:.0f} s")
    print(table(nll, min(len(nll["full"]) + 1, len(ids)), len(ids)))  # as --replot
    if args.out:
        args.out.write_text(json.dumps(nll))
    if args.plot:
        plot(nll, args.smooth, args.plot)
    eng.leak_check()


if __name__ == "__main__":
    main()
