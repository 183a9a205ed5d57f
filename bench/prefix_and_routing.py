"""Prefix caching on vs off, and prefix-aware vs round-robin routing, on shared-prefix
workloads, through the shared bench client.

1. Colocated engine, prefix caching on vs off (--worker-arg=--no-enable-prefix-caching):
   requests share one of --groups prefixes of --prefix-len tokens.
2. Two decode workers (one core each, no prefill pool, --local-prefill-threshold large
   so each decode worker prefills its own prompts), --routing prefix vs round_robin.
   Each worker's KV pool (--kv-blocks) holds about half of the groups' prefixes, so
   where a group's requests land decides whether its prefix is still cached. Requests
   come in a seeded random group order.

Prints TTFT, throughput and the prefix-cache hit rate the router expected when it
placed each request (tandem:prefix_cache_hits_predicted / tandem:router_prompt_tokens:
the chosen worker's cached blocks as its KV events reported them). The realized rate
per request (usage.prompt_tokens_details.cached_tokens) against an ideal is what
bench/prefix_hit_rate.py measures, on 2 prefill + 2 decode workers.

    .venv/bin/python bench/prefix_and_routing.py [--groups 16] [--prefix-len 1024]
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from tandem.bench import load, report, stats  # noqa: E402
from tandem.bench.client import Endpoint  # noqa: E402
from tandem.bench.script import BenchRun, shared_prefix_requests, warmup_requests  # noqa: E402
from tandem.bench.servers import tandem_up  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402


def router_counter(base_url: str, name: str) -> float:
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def settle(base_url: str, timeout_s: float = 10.0) -> None:
    """Wait until the router's prompt-token counter stops growing: it accounts a
    streamed request when the stream's generator finishes, a little after [DONE]."""
    deadline = time.monotonic() + timeout_s
    last = -1.0
    while time.monotonic() < deadline:
        now = router_counter(base_url, "tandem:router_prompt_tokens")
        if now == last:
            return
        last = now
        time.sleep(1.0)


def run_config(label: str, up_args: list[str], args, reqs, warm) -> tuple[stats.Summary, float, list]:
    """One server config: warm up, run the closed loop, return summary and hit rate."""
    with tandem_up(*up_args, "--max-model-len", "2048", model=args.model) as srv:
        ep = Endpoint(srv.url, Path(args.model).name.removesuffix(".gguf"))
        load.run(ep, warm, concurrency=1, progress=False)
        settle(srv.url)
        hits0 = router_counter(srv.url, "tandem:prefix_cache_hits_predicted")
        prompt0 = router_counter(srv.url, "tandem:router_prompt_tokens")
        res = load.run(ep, reqs, concurrency=args.concurrency, label=label)
        settle(srv.url)
        hits = router_counter(srv.url, "tandem:prefix_cache_hits_predicted") - hits0
        prompt = router_counter(srv.url, "tandem:router_prompt_tokens") - prompt0
    failed = [r for r in res.results if not r.ok]
    if failed:
        print(f"{label}: {len(failed)} failed; first: {failed[0].error}")
    return stats.summarize(res.results, res.duration_s), hits / max(prompt, 1.0), res.results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--groups", type=int, default=16, help="shared-prefix groups")
    ap.add_argument("--prefix-len", type=int, default=1024, help="tokens per shared prefix")
    ap.add_argument("--suffix-len", default="uniform:16:48", help="own tokens per request")
    ap.add_argument("--output-len", default="16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=640,
                    help="KV pool per decode worker in part 2 (16-token blocks; default 640)")
    ap.add_argument("--plot", default=None, help="PNG: TTFT/TPOT/ITL/E2E CDFs of the four runs")
    args = ap.parse_args()
    bench = BenchRun("prefix_and_routing")
    reqs, warm = shared_prefix_requests(args), warmup_requests()
    two = ["--mode", "disagg", "--prefill", "0", "--decode", "2",
           "--local-prefill-threshold", "100000", "--kv-blocks", str(args.kv_blocks)]
    configs = {
        "colocated cache on": ["--mode", "colocated"],
        "colocated cache off": ["--mode", "colocated",
                                "--worker-arg=--no-enable-prefix-caching"],
        "2 decode, prefix routing": two + ["--routing", "prefix"],
        "2 decode, round_robin": two + ["--routing", "round_robin"],
    }
    out = {label: run_config(label, up, args, reqs, warm) for label, up in configs.items()}

    print(f"\n{len(reqs)} requests, {args.groups} prefix groups x {args.prefix_len} tokens + "
          f"suffix {args.suffix_len}, output {args.output_len}, closed loop c{args.concurrency}; "
          f"part 2 KV pool {args.kv_blocks} blocks x 16 tokens per worker")
    print(report.format_table([(label, s) for label, (s, _, _) in out.items()]))
    print("\nprefix-cache hit rate (router: cached prompt tokens on the chosen worker at placement"
          " / prompt tokens)")
    for label, (_, rate, _) in out.items():
        print(f"  {label:28s} {rate:6.1%}")
    for a, b in (("colocated cache on", "colocated cache off"),
                 ("2 decode, prefix routing", "2 decode, round_robin")):
        sa, sb = out[a][0], out[b][0]
        print(f"\n  {a} vs {b}:")
        print(f"    TTFT p50 {sa.ttft.p50 * 1e3:.1f} vs {sb.ttft.p50 * 1e3:.1f} ms "
              f"({sb.ttft.p50 / sa.ttft.p50:.2f}x lower); TTFT p99 {sa.ttft.p99 * 1e3:.1f} vs "
              f"{sb.ttft.p99 * 1e3:.1f} ms")
        print(f"    throughput {sa.request_throughput:.2f} vs {sb.request_throughput:.2f} req/s "
              f"({sa.request_throughput / sb.request_throughput:.2f}x)")
    if args.plot:
        report.plot_cdfs(args.plot, [(label, rs) for label, (_, _, rs) in out.items()],
                         "shared-prefix workload")
    bench.end()


if __name__ == "__main__":
    main()
