"""Disaggregated (1 prefill + 1 decode worker, one core each) vs colocated (one engine
on both cores) on a mixed workload: short requests decode steadily while long
prompts (~1500 tokens) arrive and must be prefilled.

Both get the same open-loop schedule: short requests as a Poisson stream at
--short-rate, long ones as a second Poisson stream at --long-rate, merged. The
decode interference shows in the short requests' TPOT (colocated: a long prompt's
prefill chunks share steps with their decodes). Goodput counts requests within both
SLOs. Target: disagg p99 TPOT (short requests) <= 0.5x colocated.

    .venv/bin/python bench/disagg_vs_colocated.py [--duration 90] [--kv-transfer nixl]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from tandem.bench import datasets, load, profile, report, stats  # noqa: E402
from tandem.bench.client import Endpoint  # noqa: E402
from tandem.bench.datasets import LengthDist  # noqa: E402
from tandem.bench.script import BenchRun, add_py_spy_flag  # noqa: E402
from tandem.bench.servers import tandem_up  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402


def mixed_workload(args) -> tuple[list[datasets.BenchRequest], list[float]]:
    """Two seeded Poisson streams over --duration seconds, merged by arrival time."""
    n_short = max(1, round(args.short_rate * args.duration))
    n_long = max(1, round(args.long_rate * args.duration))
    short = datasets.synthetic(n_short, LengthDist.parse(args.short_prompt),
                               LengthDist.parse(args.short_output), seed=1, tag="short")
    long = datasets.synthetic(n_long, LengthDist.parse(args.long_prompt),
                              LengthDist.parse(args.long_output), seed=2, tag="long")
    t_short = load.poisson_arrivals(n_short, args.short_rate, seed=11)
    t_long = load.poisson_arrivals(n_long, args.long_rate, seed=12)
    merged = sorted(zip(t_short + t_long, short + long), key=lambda p: p[0])
    return [r for _, r in merged], [t for t, _ in merged]


def run_mode(mode: str, args, reqs, arrivals, warm) -> load.LoadResult:
    up = ["--mode", mode]
    if mode == "disagg":
        up += ["--prefill", "1", "--decode", "1", "--kv-transfer", args.kv_transfer]
    with tandem_up(*up, model=args.model) as srv:
        ep = Endpoint(srv.url, Path(args.model).name.removesuffix(".gguf"))
        load.run(ep, warm, concurrency=len(warm), progress=False)
        # The decode worker (the only worker when colocated).
        pid = next(p for p in srv.children() if " decode " in srv.cmdline(p)) \
            if args.py_spy else None
        with profile.sampled(pid, args.py_spy, f"disagg_vs_colocated.{mode}",
                             f"{mode} decode worker, the load"):
            return load.run(ep, reqs, arrivals=arrivals, label=mode)


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either was not measured (e.g. every request failed)."""
    return None if a is None or not b else a / b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--kv-transfer", default="nixl", choices=("nixl", "tcp"))
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals per run")
    ap.add_argument("--short-rate", type=float, default=0.5, help="short requests per second")
    ap.add_argument("--short-prompt", default="uniform:48:80")
    ap.add_argument("--short-output", default="uniform:48:80")
    ap.add_argument("--long-rate", type=float, default=0.1, help="long prompts per second")
    ap.add_argument("--long-prompt", default="normal:1500:50")
    ap.add_argument("--long-output", default="16")
    ap.add_argument("--slo-ttft", type=float, default=3000.0, help="ms (default: 3000)")
    ap.add_argument("--slo-tpot", type=float, default=150.0, help="ms (default: 150)")
    ap.add_argument("--plot", default=None, help="PNG: latency CDFs of the short requests")
    add_py_spy_flag(ap, "the decode worker", "run")
    args = ap.parse_args()
    bench = BenchRun("disagg_vs_colocated")
    reqs, arrivals = mixed_workload(args)
    warm = datasets.synthetic(3, LengthDist.parse("64"), LengthDist.parse("8"), seed=9) + \
        datasets.synthetic(1, LengthDist.parse("1500"), LengthDist.parse("4"), seed=10)
    runs = {mode: run_mode(mode, args, reqs, arrivals, warm) for mode in ("colocated", "disagg")}

    slo = {"slo_ttft": args.slo_ttft / 1e3, "slo_tpot": args.slo_tpot / 1e3}
    n_short = sum(r.tag == "short" for r in reqs)
    print(f"\n{len(reqs)} requests over {args.duration:g}s: {n_short} short "
          f"(prompt {args.short_prompt}, output {args.short_output}) at {args.short_rate:g}/s, "
          f"{len(reqs) - n_short} long (prompt {args.long_prompt}, output {args.long_output}) "
          f"at {args.long_rate:g}/s; disagg KV over {args.kv_transfer}")
    table, sums = [], {}
    for tag in (None, "short", "long"):
        for mode, res in runs.items():
            s = stats.summarize(res.results, res.duration_s, tag=tag, **slo)
            sums[mode, tag] = s
            table.append((f"{mode} {tag or 'all'}", s))
    print(report.format_table(table))
    for mode, res in runs.items():
        failed = [r for r in res.results if not r.ok]
        if failed:
            print(f"{mode}: {len(failed)} failed; first: {failed[0].error}")

    d, c = sums["disagg", "short"], sums["colocated", "short"]
    print(f"\n  short-request TPOT p99: disagg {report.fmt_ms(d.tpot.p99)} ms, "
          f"colocated {report.fmt_ms(c.tpot.p99)} ms")
    print("  " + report.target_line("p99 TPOT ratio disagg/colocated",
                                    _ratio(d.tpot.p99, c.tpot.p99), "<=", 0.5))
    for tag in (None, "short", "long"):
        d, c = sums["disagg", tag], sums["colocated", tag]
        print(f"  {tag or 'all':5s} TTFT p99: disagg {report.fmt_ms(d.ttft.p99):>8s} ms, colocated "
              f"{report.fmt_ms(c.ttft.p99):>8s} ms ({_ratio(d.ttft.p99, c.ttft.p99) or 0:.2f}x);  "
              f"goodput: disagg "
              f"{d.goodput:.3f} req/s ({d.slo_attainment:.0%}), colocated {c.goodput:.3f} req/s "
              f"({c.slo_attainment:.0%})")
    if args.plot:
        report.plot_cdfs(args.plot, [(f"{m} short", [r for r in res.results if r.request.tag ==
                                                     "short"]) for m, res in runs.items()],
                         "short requests under long-prompt arrivals")
    bench.end()


if __name__ == "__main__":
    main()
