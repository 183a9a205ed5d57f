"""Chaos soak: `tandem up --prefill 2 --decode 2` under mixed load for N minutes while a
prefill worker, a decode worker and the router are killed (SIGKILL) in a cycle and
clients misbehave; the same audit as tests/chaos, plus every process's RSS over time
and latency per minute.

    .venv/bin/python bench/chaos.py --minutes 30            # the embedded model, fp32
    .venv/bin/python bench/chaos.py --minutes 2 --model DIR  # any model

Prints one line per minute (requests by outcome, p50/p99 latency of the answered ones,
RSS of each process) and a verdict: wrong answers, late answers, unclear errors,
leaks, and RSS growth after warm-up (target: under 5%). --json FILE keeps it all.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.bench.chaos import (ChaosReport, Fault, UpCluster, make_cases,  # noqa: E402
                                references, run_load)
from tandem.fetch_model import default_model_path  # noqa: E402
from tandem.process import free_port  # noqa: E402

CYCLE_S = 120.0
"""One fault cycle: prefill at +20 s, decode at +50 s, router at +80 s."""


def faults_for(minutes: float) -> list[Fault]:
    out, start = [], 0.0
    while start + 80 < minutes * 60 - 20:
        out += [Fault(start + 20, "prefill"), Fault(start + 50, "decode"),
                Fault(start + 80, "router")]
        start += CYCLE_S
    return out


def rss_growth(samples: list[dict], warm_s: float) -> dict[str, float]:
    """Per process that kept its pid after warm-up: RSS growth from the first three
    samples after warm-up to the last three, in percent (restarted ones start over)."""
    warm = [s for s in samples if s["t"] >= warm_s]
    out: dict[str, float] = {}
    if len(warm) < 2:
        return out
    for name, (pid, _) in warm[0]["rss"].items():
        series = [s["rss"][name][1] for s in warm if s["rss"].get(name, (None,))[0] == pid]
        if len(series) == len(warm):
            first, last = statistics.median(series[:3]), statistics.median(series[-3:])
            out[name] = (last - first) / first * 100 if first else 0.0
    return out


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--warmup-minutes", type=float, default=3.0,
                    help="RSS growth is measured from the end of the warm-up (default: 3)")
    ap.add_argument("--json", default=None, help="write every sample and the audit here")
    args = ap.parse_args()

    cases = make_cases(vocab=49152 if args.model.endswith(".gguf") else 320)
    print(f"computing references for {len(cases)} prompts ...", flush=True)
    refs = references(args.model, cases)
    cluster = UpCluster(args.model, free_port(), [
        "--prefill", "2", "--decode", "2", "--dtype", "float32", "--kv-blocks", "256",
        "--max-model-len", "512", "--local-prefill-threshold", "8", "--swap-space", "0.05",
        "--decode-arg=--max-num-seqs=8"])
    samples: list[dict] = []
    minute_marks: list[int] = [0]

    def tick(elapsed: float, report: ChaosReport) -> None:
        if not samples or elapsed - samples[-1]["t"] >= 10:
            samples.append({"t": round(elapsed), "rss": cluster.rss_mib()})
        minute = int(elapsed // 60)
        if minute >= len(minute_marks):
            lo = minute_marks[-1]
            minute_marks.append(len(report.outcomes))
            window = report.outcomes[lo:minute_marks[-1]]
            lat = [o.ended - o.started for o in window if o.kind == "ok"]
            kinds = {k: sum(1 for o in window if o.kind == k)
                     for k in ("ok", "error", "refused", "dropped", "invalid")}
            rss = samples[-1]["rss"] if samples else {}
            print(f"minute {minute:3d}: {kinds} p50 {pct(lat, 0.5):.2f}s p99 {pct(lat, 0.99):.2f}s "
                  f"rss {{{', '.join(f'{k}: {v:.0f}' for k, (_, v) in rss.items())}}} MiB",
                  flush=True)
            samples[-1]["minute"] = {"n": kinds, "p50_s": pct(lat, 0.5), "p99_s": pct(lat, 0.99)}

    t0 = time.monotonic()
    try:
        cluster.wait_ready()
        print(f"cluster up in {time.monotonic() - t0:.0f}s; load for {args.minutes} min", flush=True)
        report = run_load(cluster, cases, refs, args.minutes * 60, faults_for(args.minutes),
                          clients=args.clients, on_tick=tick)
    finally:
        cluster.stop()
    growth = rss_growth(samples, args.warmup_minutes * 60)
    print(report.summary())
    print("RSS growth after warm-up, processes that ran throughout: "
          + ", ".join(f"{k} {v:+.1f}%" for k, v in growth.items()))
    ok = report.ok and all(v < 5.0 for v in growth.values())
    print("verdict:", "PASS" if ok else "FAIL")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "samples": [{**s, "rss": {k: v for k, (_, v) in s["rss"].items()}} for s in samples],
            "counts": report.counts(), "faults": report.faults_done,
            "wrong": report.wrong, "late": report.late, "unclear": report.unclear,
            "leaks": report.leaks, "rss_growth_pct": growth}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
