"""Prefix-hit rate of the router on 2 prefill + 2 decode workers: prefix-aware
against round-robin placement, in one run.

--groups system prompts of --prefix-len tokens each are shared by --num-prompts
requests (each adds its own short question), sent in a seeded random group order
at closed-loop --concurrency. Each prefill worker's KV pool (--prefill-kv-blocks)
holds about two of the system prompts, so where a group's requests land decides
whether its prompt is still cached.

Per request, the router reports the prompt tokens the prefilling worker served from
its prefix cache (usage.prompt_tokens_details.cached_tokens). The ideal is what a
single cache of unlimited size would serve: every request but the first of its group
finds the group's shared prompt (in whole 16-token blocks). Prints, per policy: the
realized hit rate against that ideal (target >= 90% for prefix routing), and TTFT of
hits (at least half the prompt cached) against misses (target: hits <= 0.2x misses).

    .venv/bin/python bench/prefix_hit_rate.py [--groups 4] [--prefix-len 1024] [--num-prompts 40]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from core.tokenizer import Tokenizer  # noqa: E402
from tandem.bench import load, report, stats  # noqa: E402
from tandem.bench.client import Endpoint, RequestResult  # noqa: E402
from tandem.bench.datasets import BenchRequest  # noqa: E402
from tandem.bench.script import BenchRun, shared_prefix_requests, warmup_requests  # noqa: E402
from tandem.bench.servers import tandem_up  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402

BLOCK = 16


def ideal_cached(reqs: list[BenchRequest], tok: Tokenizer) -> list[int]:
    """Per request, in send order: the tokens an unbounded cache could serve, i.e. the
    longest whole-block common prefix with any earlier request of its group."""
    seen: dict[int, list[list[int]]] = {}
    out = []
    for r in reqs:
        ids = tok.encode(r.prompt)
        out.append(stats.ideal_cached_tokens(ids, seen.get(r.group, []), BLOCK))
        seen.setdefault(r.group, []).append(ids)
    return out


def run_policy(routing: str, args, reqs, warm) -> list[RequestResult]:
    up = ["--mode", "disagg", "--prefill", "2", "--decode", "2", "--routing", routing,
          "--max-model-len", "2048", f"--prefill-arg=--kv-blocks={args.prefill_kv_blocks}"]
    with tandem_up(*up, model=args.model) as srv:
        ep = Endpoint(srv.url, Path(args.model).name.removesuffix(".gguf"))
        load.run(ep, warm, concurrency=1, progress=False)
        res = load.run(ep, reqs, concurrency=args.concurrency, label=f"2P+2D {routing}")
    failed = [r for r in res.results if not r.ok]
    if failed:
        print(f"{routing}: {len(failed)} failed; first: {failed[0].error}")
    return res.results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--groups", type=int, default=4, help="shared system prompts (default: 4)")
    ap.add_argument("--prefix-len", type=int, default=1024,
                    help="tokens per system prompt (default: 1024)")
    ap.add_argument("--suffix-len", default="uniform:16:48", help="own tokens per request")
    ap.add_argument("--output-len", default="16")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prefill-kv-blocks", type=int, default=200,
                    help="KV pool per prefill worker, 16-token blocks (default: 200, about "
                         "two system prompts of 1024 tokens)")
    ap.add_argument("--plot", default=None, help="PNG: TTFT CDFs of hits and misses per policy")
    args = ap.parse_args()
    bench = BenchRun("prefix_hit_rate")
    reqs, warm = shared_prefix_requests(args), warmup_requests()
    ideal = dict(zip(map(id, reqs), ideal_cached(reqs, Tokenizer.from_gguf(args.model))))
    ideal_total = sum(ideal.values())

    runs = {policy: run_policy(policy, args, reqs, warm) for policy in ("prefix", "round_robin")}

    print(f"\n2 prefill + 2 decode workers; {len(reqs)} requests over {args.groups} system "
          f"prompts of {args.prefix_len} tokens + suffix {args.suffix_len}, output "
          f"{args.output_len}, closed loop c{args.concurrency}; prefill KV pool "
          f"{args.prefill_kv_blocks} blocks each")
    print(f"ideal (unbounded single cache): {ideal_total} cached prompt tokens\n")
    tables, cdfs, rates = [], [], {}
    for policy, results in runs.items():
        ok = [r for r in results if r.ok]
        cached = sum(r.usage_cached_tokens or 0 for r in ok)
        rates[policy] = cached / max(ideal_total, 1)
        hits = [r for r in ok if (r.usage_cached_tokens or 0) * 2 >= r.prompt_tokens]
        misses = [r for r in ok if (r.usage_cached_tokens or 0) * 2 < r.prompt_tokens]
        tables += [(f"{policy} hits", stats.summarize(hits, 1.0)),
                   (f"{policy} misses", stats.summarize(misses, 1.0))]
        cdfs += [(f"{policy} hits", hits), (f"{policy} misses", misses)]
        print(f"{policy:12s} realized {cached:6d} cached prompt tokens = {rates[policy]:6.1%} of "
              f"ideal; {len(hits)} hits, {len(misses)} misses")
    print()
    skip = ("duration", "requests/s", "output tokens/s", "total tokens/s")  # per-class: n/a
    print("\n".join(line for line in report.format_table(tables).splitlines()
                    if not line.startswith(skip)))
    print()
    print("  " + report.target_line("prefix routing: realized / ideal hit rate",
                                    rates["prefix"], ">=", 0.9, unit=""))
    print(f"  round_robin: realized / ideal hit rate {rates['round_robin']:.3f}")
    for policy in runs:
        h, m = dict(tables)[f"{policy} hits"].ttft, dict(tables)[f"{policy} misses"].ttft
        if h.p50 is None or m.p50 is None:
            print(f"  {policy}: TTFT hits vs misses: not both present")
            continue
        print(f"  {policy}: TTFT p50 hits {h.p50 * 1e3:.1f} ms vs misses {m.p50 * 1e3:.1f} ms")
        print("  " + report.target_line(f"{policy}: TTFT p50 hits / misses", h.p50 / m.p50,
                                        "<=", 0.2))
    if args.plot:
        report.plot_cdfs(args.plot, cdfs, "2P+2D shared system prompts")
    bench.end()


if __name__ == "__main__":
    main()
