"""Multi-turn conversations whose history is many times the device KV pool: Tandem with
host-memory tiers against Tandem device-only, in one run (issue 29's acceptance).

--conversations conversations of --turns turns each. A conversation opens with its own
--system-len tokens; every turn adds a user message of --user-len tokens, and the next
turn's prompt is the whole history: the earlier prompts, the answers (--answer-len
tokens, EOS ignored) and the new message, as token ids, exactly as the model produced
them. Turns go in turn-major order (every conversation's turn 1, then every turn 2, ...)
at closed-loop --concurrency, so between two turns of one conversation all the others
pass through the workers. Each worker's device pool (--kv-blocks) is the whole history
(every conversation's final context) divided by --history-ratio.

Both clusters are `tandem up --mode disagg` (1 prefill + 1 decode worker, TCP KV
transfer, the default --local-prefill-threshold 32); the tiered one adds
--kv-offload-cpu-gib to every worker, nothing else differs.

Hit rate: per request, the router's usage.prompt_tokens_details.cached_tokens (and its
cached_tokens_by_tier), against the ideal of a single unbounded cache of everything the
cluster computed: for turn k, the whole blocks of its longest common prefix with an
earlier turn's prompt and answer (the answer's last token is never computed), all but
the prompt's last token. Prints, per cluster: realized / ideal, the hits by tier, TTFT
p50/p99 and throughput; then the targets (tiers: TTFT p50 <= 0.3x device-only, realized
>= 90% of the ideal).

    .venv/bin/python bench/multiturn_tiers.py [--model PATH] [--conversations 64] [--turns 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
import httpx  # noqa: E402

from core.kv import blocks_for  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.bench.script import BenchRun  # noqa: E402
from tandem.bench.servers import tandem_up  # noqa: E402
from tandem.bench.stats import ideal_cached_tokens, percentile  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402

BLOCK = 16
TIERS = ("device", "host", "disk")


@dataclass
class Turn:
    """One request of a conversation: what was sent and what came back."""

    conv: int
    turn: int
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    ttft: float | None = None
    e2e: float | None = None
    cached: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    error: str = ""


@dataclass
class Conversation:
    system: list[int]
    users: list[list[int]]
    turns: list[Turn] = field(default_factory=list)
    done: list[asyncio.Event] = field(default_factory=list)

    def prompt(self, k: int) -> list[int]:
        """Turn k's prompt (0-based): the system part, then per earlier turn its user
        message and answer, then turn k's message."""
        out = list(self.system)
        for j in range(k):
            out += self.users[j] + self.turns[j].output
        return out + self.users[k]


def conversations(args) -> list[tuple[list[int], list[list[int]]]]:
    """Each conversation's (system tokens, user messages), seeded."""
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, args.max_token_id) for _ in range(n)]  # noqa: E731
    return [(ids(args.system_len), [ids(args.user_len) for _ in range(args.turns)])
            for _ in range(args.conversations)]


def context_len(args) -> int:
    """A conversation's final context (its last prompt and answer), in tokens."""
    return args.system_len + args.turns * (args.user_len + args.answer_len)


def pool_blocks(args) -> tuple[int, int]:
    """(the history in blocks: every conversation's final context, the device pool)."""
    history = args.conversations * blocks_for(context_len(args), BLOCK)
    return history, history // args.history_ratio


def ideal_cached(conv: Conversation, k: int) -> int:
    """What one unbounded cache of everything computed serves of turn k's prompt."""
    # an answer's last token is sampled, never computed into the cache
    return ideal_cached_tokens(conv.turns[k].prompt, (
        t.prompt + t.output[:-1] for t in conv.turns[:k]), BLOCK)


async def send(client: httpx.AsyncClient, url: str, model: str, turn: Turn, max_tokens: int) -> None:
    """Stream one completion; fill turn's output ids, TTFT (first token), e2e and usage."""
    body = {"model": model, "prompt": turn.prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/completions", json=body) as resp:
            if resp.status_code != 200:
                turn.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                _absorb(turn, json.loads(line[5:]), time.perf_counter() - t0)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        turn.error = f"{type(e).__name__}: {e}"
    turn.e2e = time.perf_counter() - t0
    if not turn.error and len(turn.output) != max_tokens:
        turn.error = f"{len(turn.output)} tokens, not {max_tokens}"


def _absorb(turn: Turn, event: dict, now: float) -> None:
    if "error" in event:
        turn.error = json.dumps(event["error"])[:300]
    for choice in event.get("choices") or ():
        ids = choice.get("token_ids") or []
        if ids and turn.ttft is None:
            turn.ttft = now
        turn.output += ids
    details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
    turn.cached = details.get("cached_tokens") or turn.cached
    turn.by_tier = details.get("cached_tokens_by_tier") or turn.by_tier


async def run_trace(url: str, model: str, args) -> tuple[list[Conversation], float]:
    """Every turn of every conversation, turn-major, at closed-loop concurrency; (the
    conversations with their turns, the wall time)."""
    convs = [Conversation(s, u) for s, u in conversations(args)]
    for c in convs:
        c.done = [asyncio.Event() for _ in range(args.turns)]
    todo = [(i, k) for k in range(args.turns) for i in range(len(convs))]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        async def worker() -> None:
            while todo:
                i, k = todo.pop(0)
                c = convs[i]
                if k:
                    await c.done[k - 1].wait()  # its previous answer is part of the prompt
                turn = Turn(i, k, c.prompt(k))
                c.turns.append(turn)
                await send(client, url, model, turn, args.answer_len)
                c.done[k].set()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return convs, time.perf_counter() - t0


def run_cluster(label: str, extra: list[str], args) -> dict:
    history, pool = pool_blocks(args)
    tmp = Path(tempfile.mkdtemp())
    log = tmp / "requests.jsonl"
    up = ["--mode", "disagg", "--prefill", "1", "--decode", "1", "--kv-transfer", "tcp",
          "--kv-blocks", str(pool), "--max-model-len", str(context_len(args)),
          "--log-requests", str(log), *extra]
    print(f"{label}: tandem up {' '.join(up)} (its output: {tmp / 'up.log'})", flush=True)
    with tandem_up(*up, model=args.model, log=tmp / "up.log") as srv:
        convs, wall = asyncio.run(run_trace(srv.url, Path(args.model).name.removesuffix(".gguf"),
                                            args))
    paths = Counter(json.loads(line)["path"] for line in log.read_text().splitlines())
    return summarize(label, convs, wall, paths)


def summarize(label: str, convs: list[Conversation], wall: float, paths: Counter) -> dict:
    turns = [t for c in convs for t in c.turns]
    ok = [t for t in turns if not t.error]
    ideal = sum(ideal_cached(c, t.turn) for c in convs for t in c.turns if not t.error)
    later = [t.ttft for t in ok if t.turn > 0]
    return {
        "label": label, "requests": len(turns), "failed": len(turns) - len(ok),
        "first_error": next((t.error for t in turns if t.error), ""),
        "cached": sum(t.cached for t in ok), "ideal": ideal,
        "by_tier": {k: sum(t.by_tier.get(k, 0) for t in ok) for k in TIERS},
        "ttft_p50": percentile([t.ttft for t in ok], 50),
        "ttft_p99": percentile([t.ttft for t in ok], 99),
        "later_ttft_p50": percentile(later, 50), "later_ttft_p99": percentile(later, 99),
        "output_tok_s": sum(len(t.output) for t in ok) / wall, "req_s": len(ok) / wall,
        "wall_s": wall, "paths": dict(paths)}


def print_table(runs: list[dict]) -> None:
    rows = [
        ("requests (failed)", lambda r: f"{r['requests']} ({r['failed']})"),
        ("cached prompt tokens", lambda r: f"{r['cached']:,}"),
        ("ideal (unbounded cache)", lambda r: f"{r['ideal']:,}"),
        ("realized / ideal", lambda r: f"{r['cached'] / max(r['ideal'], 1):.1%}"),
        ("hits device / host / disk", lambda r: " / ".join(f"{r['by_tier'][k]:,}" for k in TIERS)),
        ("TTFT p50 (ms)", lambda r: report.fmt_ms(r["ttft_p50"])),
        ("TTFT p99 (ms)", lambda r: report.fmt_ms(r["ttft_p99"])),
        ("TTFT p50, turns 2+ (ms)", lambda r: report.fmt_ms(r["later_ttft_p50"])),
        ("TTFT p99, turns 2+ (ms)", lambda r: report.fmt_ms(r["later_ttft_p99"])),
        ("output tok/s", lambda r: f"{r['output_tok_s']:.1f}"),
        ("requests/s", lambda r: f"{r['req_s']:.2f}"),
        ("wall (s)", lambda r: f"{r['wall_s']:.0f}"),
        ("paths", lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r["paths"].items()))),
    ]
    print("| | " + " | ".join(r["label"] for r in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for name, cell in rows:
        print(f"| {name} | " + " | ".join(cell(r) for r in runs) + " |")
    for r in runs:
        if r["failed"]:
            print(f"{r['label']}: {r['failed']} failed; first: {r['first_error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=64, help="tokens opening each conversation")
    ap.add_argument("--user-len", type=int, default=16, help="tokens of each user message")
    ap.add_argument("--answer-len", type=int, default=16, help="tokens of each answer")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--history-ratio", type=int, default=8,
                    help="the whole history over each worker's device pool (default: 8)")
    ap.add_argument("--offload-cpu-gib", type=float, default=1.0,
                    help="--kv-offload-cpu-gib of every worker in the tiered cluster")
    ap.add_argument("--max-token-id", type=int, default=30000,
                    help="prompt token ids are drawn below this (the model's vocabulary)")
    args = ap.parse_args()
    bench = BenchRun("multiturn_tiers")
    history, pool = pool_blocks(args)
    print(f"{args.conversations} conversations x {args.turns} turns: system {args.system_len}, "
          f"user {args.user_len}, answer {args.answer_len} tokens; closed loop "
          f"c{args.concurrency}; history {history} blocks = {args.history_ratio}x a "
          f"{pool}-block device pool per worker; model {args.model}", flush=True)
    runs = [run_cluster("device only", [], args),
            run_cluster("tiers", [f"--worker-arg=--kv-offload-cpu-gib={args.offload_cpu_gib}"],
                        args)]
    print()
    print_table(runs)
    base, tiers = runs
    print()
    ratio = (tiers["ttft_p50"] / base["ttft_p50"]) if base["ttft_p50"] else None
    print("  " + report.target_line("tiers: TTFT p50 / device-only", ratio, "<=", 0.3))
    print("  " + report.target_line("tiers: realized / ideal hit rate",
                                    tiers["cached"] / max(tiers["ideal"], 1), ">=", 0.9, unit=""))
    print(f"  throughput: tiers / device-only {tiers['output_tok_s'] / base['output_tok_s']:.2f}x")
    bench.end()


if __name__ == "__main__":
    main()
