"""Preemption costs and priority isolation.

1. Resume latency by swap and by recompute for 256..2048-token contexts (in-process
   engine on SmolLM2): swap = copy the request's blocks host -> device and run its
   next decode step; recompute = prefill the whole context again.
2. High-priority TPOT and TTFT p99 under load: a decode worker busy with --low long
   low-priority requests while --high high-priority requests run one at a time,
   against the same high-priority requests on an idle cluster (targets: TPOT <= 1.5x,
   TTFT <= 2x), once per --priority-batch-cap value in --caps. Each phase first runs
   one uncounted high-priority request (warm-up: the first request of a phase pays
   one-off costs, such as new kernel shapes).

    .venv/bin/python bench/bench_preemption.py [--quick] [--part all|resume|priority] [--caps 0,2]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from core.sampling import SamplingParams  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402


def resume_latency(model: str, dtype: str, contexts: list[int], reps: int) -> list[tuple]:
    eng = LLMEngine(EngineConfig.from_flat(model=model, dtype=dtype, max_model_len=4096,
                                           num_kv_blocks=1024, enable_prefix_caching=False))
    rows = []
    for ctx in contexts:
        ids = [(i * 31) % 40000 + 100 for i in range(ctx)]
        swap_t, rec_t = [], []
        for _ in range(reps):
            rid = eng.add_request(ids, SamplingParams(max_tokens=64, ignore_eos=True))
            t0 = time.perf_counter()
            while eng.requests[rid].num_output_tokens < 1:  # prefill (chunks) + first token
                eng.step()
            rec_t.append(time.perf_counter() - t0)  # what a recompute re-admission costs
            req = eng.requests[rid]
            table = eng.kv.table(rid)[: eng.kv.blocks_needed(req.num_computed_tokens)]
            host = list(range(len(table)))
            eng.runner.copy_blocks([(table, host)], [])
            t0 = time.perf_counter()
            eng.runner.copy_blocks([], [(host, table)])  # swap in ...
            eng.step()  # ... and its next decode step
            swap_t.append(time.perf_counter() - t0)
            eng.abort(rid)
        rows.append((ctx, statistics.median(swap_t) * 1e3, statistics.median(rec_t) * 1e3))
    eng.leak_check()
    return rows


async def _stream(client, url: str, body: dict, ttfts: list[float] | None = None) -> list[float]:
    """Inter-token gaps of one streamed request (its TTFT appended to ttfts)."""
    gaps, last, t0 = [], None, time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                             timeout=600) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                elif ttfts is not None:
                    ttfts.append(now - t0)
                last = now
    return gaps


async def priority_tpot(url: str, n_low: int, n_high: int, busy: bool,
                        ttfts: list[float] | None = None) -> list[float]:
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n_low + n_high + 4)) as c:
        low = []
        if busy:
            low = [asyncio.create_task(_stream(c, url, {
                "prompt": f"Tell a long story number {i} about the sea.", "max_tokens": 200,
                "ignore_eos": True, "priority": 10})) for i in range(n_low)]
            await asyncio.sleep(3.0)  # the low-priority batch is running
        tpots = []
        for i in range(-1, n_high):  # the first (i = -1) warms this phase up, uncounted
            gaps = await _stream(c, url, {"prompt": f"Question {i}: what is the capital of France?",
                                          "max_tokens": 32, "ignore_eos": True, "priority": 0},
                                 ttfts if i >= 0 else None)
            if i >= 0:
                tpots += gaps
        for t in low:
            t.cancel()
        await asyncio.gather(*low, return_exceptions=True)
    return tpots


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quick", action="store_true", help="fewer contexts and requests")
    ap.add_argument("--low", type=int, default=64, help="long low-priority requests")
    ap.add_argument("--high", type=int, default=8, help="high-priority requests")
    ap.add_argument("--caps", default="0,2",
                    help="--priority-batch-cap values to run the flood with (default: 0,2; "
                         "0 = no cap, 2 = the workers' default)")
    ap.add_argument("--part", choices=("all", "resume", "priority"), default="all")
    args = ap.parse_args()
    if args.part != "priority":
        contexts = [256, 1024] if args.quick else [256, 512, 1024, 2048]
        rows = resume_latency(args.model, args.dtype, contexts, 1 if args.quick else 3)
        print("\nresume latency (ms, median): swap-in + next step  vs  recompute (prefill)")
        print(f"{'context':>8} {'swap':>9} {'recompute':>10} {'ratio':>7}")
        for ctx, s, r in rows:
            print(f"{ctx:8d} {s:9.1f} {r:10.1f} {r / s:6.1f}x")
    if args.part != "resume":
        flood(args)


def flood(args) -> None:
    """Part 2: high-priority TPOT and TTFT under a low-priority flood vs an idle cluster."""
    from tests.cluster.launch import cluster
    low = 8 if args.quick else args.low
    print(f"\nhigh-priority TPOT p99 (1 prefill + 1 decode worker, {args.high} high-priority "
          f"requests of 32 tokens, one at a time)")
    idle = None
    for cap in (int(c) for c in args.caps.split(",")):
        wargs = ["--dtype", args.dtype, "--priority-batch-cap", str(cap)]
        with cluster(args.model, "nixl", worker_args=wargs) as c:
            if idle is None:
                idle_ttft: list[float] = []
                idle = p99(asyncio.run(priority_tpot(c.url, low, args.high, False, idle_ttft)))
                print(f"  idle cluster: TPOT p99 {idle * 1e3:.1f} ms, TTFT p50 "
                      f"{statistics.median(idle_ttft) * 1e3:.1f} ms, p99 "
                      f"{p99(idle_ttft) * 1e3:.1f} ms", flush=True)
            ttft: list[float] = []
            loaded = p99(asyncio.run(priority_tpot(c.url, low, args.high, True, ttft)))
            tr = p99(ttft) / p99(idle_ttft)
            print(f"  high-priority TTFT under the flood: p50 {statistics.median(ttft) * 1e3:.1f}"
                  f" ms, p99 {p99(ttft) * 1e3:.1f} ms -> "
                  f"{tr:.2f}x idle (target <= 2x: {'met' if tr <= 2 else 'missed'})")
        ratio = loaded / idle
        print(f"  under {low} low-priority requests, --priority-batch-cap {cap}: "
              f"{loaded * 1e3:.1f} ms -> {ratio:.2f}x idle (target <= 1.5x: "
              f"{'met' if ratio <= 1.5 else f'missed by {ratio / 1.5:.2f}x'})")


if __name__ == "__main__":
    main()
