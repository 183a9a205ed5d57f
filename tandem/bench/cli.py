"""`tandem bench`: load an OpenAI-compatible endpoint and report latency, throughput
and goodput. One run per --rate value (open loop, Poisson arrivals) or one closed-loop
run at --concurrency."""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import httpx

from tandem.bench import datasets, load, report, stats
from tandem.bench.client import Endpoint


def add_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="API root ending in /v1 (default: http://127.0.0.1:8000/v1)")
    g.add_argument("--model", default="",
                   help="model name to send (default: the first one /v1/models lists)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY")
                   or os.environ.get("TANDEM_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY, else $TANDEM_API_KEY)")
    g.add_argument("--chat", action="store_true",
                   help="use /chat/completions (prompt as one user message)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may end before max_tokens)")
    g.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="synthetic",
                   help="'synthetic' or a JSONL file of {\"prompt\": ..., \"max_tokens\": ...}")
    g.add_argument("--num-prompts", type=int, default=100, help="requests per run (default: 100)")
    g.add_argument("--input-len", default="128",
                   help="prompt tokens (suffix tokens with --prefix-groups): N, fixed:N, "
                        "uniform:LO:HI or normal:MEAN:STD (default: 128)")
    g.add_argument("--output-len", default="128",
                   help="max_tokens, same forms as --input-len (default: 128)")
    g.add_argument("--prefix-groups", type=int, default=0,
                   help="requests share one of this many prefixes (default: 0, none)")
    g.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared prefix")
    g.add_argument("--seed", type=int, default=0, help="dataset and arrival seed (default: 0)")
    g = p.add_argument_group("load")
    g.add_argument("--rate", default=None,
                   help="open loop: request rate(s) in req/s, comma-separated; 'inf' sends "
                        "all at once; one run per value")
    g.add_argument("--concurrency", type=int, default=None,
                   help="closed loop with this many clients; with --rate, the cap on "
                        "requests in flight")
    g.add_argument("--warmup", type=int, default=2,
                   help="requests sent (and discarded) before the runs (default: 2)")
    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in ms for goodput")
    g.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in ms for goodput")
    g.add_argument("--json", default=None, help="write the summaries and timelines here")
    g.add_argument("--plot-dir", default=None,
                   help="write PNGs here: latency CDFs, and throughput/goodput vs rate "
                        "when several rates are given")
    g.add_argument("--label", default="", help="name of this endpoint in the table and plots")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")


def parse_rates(spec: str | None) -> list[float]:
    if spec is None:
        return []
    try:
        rates = [math.inf if x.strip().lower() == "inf" else float(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--rate {spec!r}: comma-separated numbers or 'inf' expected") from None
    if any(r <= 0 for r in rates):
        raise ValueError("--rate values must be > 0")
    return rates


def first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=10)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"could not list models at {base_url}/models ({e}); pass --model") from e


def build_requests(args: argparse.Namespace) -> list[datasets.BenchRequest]:
    if args.dataset != "synthetic":
        return datasets.from_jsonl(args.dataset, limit=args.num_prompts)
    return datasets.synthetic(
        args.num_prompts, datasets.LengthDist.parse(args.input_len),
        datasets.LengthDist.parse(args.output_len), seed=args.seed,
        prefix_groups=args.prefix_groups, prefix_len=args.prefix_len)


def run_label(base: str, rate: float | None, concurrency: int | None) -> str:
    parts = [base] if base else []
    if rate is not None:
        parts.append(f"rate {rate:g}/s")
    if concurrency is not None:
        parts.append(f"c{concurrency}")
    return " ".join(parts)


def run_bench(args: argparse.Namespace) -> int:
    rates = parse_rates(args.rate)
    if not rates and args.concurrency is None:
        raise ValueError("give --rate (open loop) or --concurrency (closed loop)")
    model = args.model or first_model(args.base_url, args.api_key)
    endpoint = Endpoint(args.base_url, model, args.api_key, args.chat, args.ignore_eos,
                        args.temperature)
    requests = build_requests(args)
    slo_ttft = args.slo_ttft / 1e3 if args.slo_ttft is not None else None
    slo_tpot = args.slo_tpot / 1e3 if args.slo_tpot is not None else None
    if args.warmup:
        load.run(endpoint, requests[:args.warmup], concurrency=args.warmup, progress=False)
    runs = []
    for rate in rates or [None]:
        res = load.run(endpoint, requests, rate=rate, concurrency=args.concurrency,
                       seed=args.seed, label=run_label(args.label, rate, args.concurrency),
                       progress=args.progress)
        summary = stats.summarize(res.results, res.duration_s, slo_ttft=slo_ttft,
                                  slo_tpot=slo_tpot)
        runs.append((res.label or "run", summary, res.results, rate))
        failed = [r for r in res.results if not r.ok]
        if failed:
            print(f"{res.label}: {len(failed)} requests failed; first: {failed[0].error}")
    print(f"\n{endpoint.url}  model {model}  {len(requests)} requests  "
          f"input {args.input_len}  output {args.output_len}"
          + (f"  prefix {args.prefix_groups}x{args.prefix_len}" if args.prefix_groups else ""))
    print(report.format_table([(label, s) for label, s, _, _ in runs]))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("run", "api_key")}
        report.write_json(args.json, {**config, "model": model}, [r[:3] for r in runs])
        print(f"wrote {args.json}")
    if args.plot_dir:
        out = Path(args.plot_dir)
        written = [report.plot_cdfs(out / "latency_cdf.png", [(l, rs) for l, _, rs, _ in runs],
                                    args.label)]
        if len(rates) > 1:
            written.append(report.plot_vs_rate(
                out / "throughput_vs_rate.png",
                {args.label or "endpoint": [(rate, s) for _, s, _, rate in runs]}, args.label))
        for w in written:
            if w is not None:
                print(f"wrote {w}")
    return 0 if all(s.completed for _, s, _, _ in runs) else 1
