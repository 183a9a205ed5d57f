"""Speculative decoding: batch-1 TPOT with and without it, per proposer, in process.

Workloads (chat prompts, greedy, EOS ends them, at most --max-tokens):
- grounded: rewrite a function with an identifier renamed, extract fields as JSON,
  summarise a passage quoting it: the answer copies the input (n-gram's strength);
- chat: free-form questions (little to copy: the adaptive off switch must keep the
  slowdown small);
and a c32 phase: 32 chat requests at once (speculation turns off above
--speculative-max-batch rows), output tokens/s.

For each method it prints TPOT (decode time after the first token / tokens after the
first, per request; the median over --rounds), the speedup against no speculation,
acceptance rate and tokens per verified row (mean accepted length, the target's own
token included). Each method has its own engine, all loaded first; the rounds then run
every prompt on every method in turn, so each comparison is made minutes, not a whole
run, apart (this host's speed drifts by 30% from one minute to the next).

    python bench/spec_decode.py [--model PATH] [--methods none,ngram,suffix,self:6]
                                [--k 7 | --methods none,ngram/4,ngram/7]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from core.sampling import SamplingParams  # noqa: E402
from tandem.bench.servers import Noise, load_note  # noqa: E402

DEFAULT_MODEL = os.environ.get("TANDEM_MODEL",
                               str(Path.home() / ".cache/tandem/SmolLM2-135M-Instruct.Q4_1.gguf"))

FUNCTION = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
PASSAGE = ("The city council met on Tuesday to discuss the new library. The mayor said "
           "\"the library will open in March and will be free for every resident\". "
           "Several members asked about the cost. The treasurer answered that \"the budget "
           "is fixed at two million dollars and will not grow\". The meeting ended at nine.")
RECORD = ("Order 4471 was placed by Maria Lopez on 12 May 2024. She bought 3 blue chairs "
          "for 45 dollars each and asked for delivery to 18 Harbour Street, Lisbon. "
          "Her phone number is 555-0142.")
GROUNDED = {
    "rewrite": f"Rewrite this Python function, renaming the variable subtotal to "
               f"running_total. Output only the code.\n\n{FUNCTION}",
    "extract": f"Extract the order id, customer name, date, item, quantity, price and "
               f"address from this text as JSON.\n\n{RECORD}",
    "summarise": f"Summarise this passage in two sentences, quoting the mayor and the "
                 f"treasurer exactly.\n\n{PASSAGE}",
}
CHAT = {
    "story": "Tell me a short story about a lighthouse keeper.",
    "advice": "What are three good habits for learning a new language?",
    "explain": "Explain why the sky is blue to a ten year old.",
}


def engine_for(model: str, method: str, k: int) -> LLMEngine:
    """method: none, ngram, suffix, self:N or draft:PATH, with /K for its own length."""
    head, sep, own_k = method.rpartition("/")
    if sep and own_k.isdigit():  # not a draft model's path
        method, k = head, int(own_k)
    kw: dict = {}
    if method.startswith("self:") or method.startswith("draft:"):
        kw = {"speculative_method": "draft", "speculative_model": method.removeprefix("draft:")}
    elif method != "none":
        kw = {"speculative_method": method}
    return LLMEngine(EngineConfig.from_flat(model=model, max_model_len=2048, max_num_seqs=32,
                                            num_speculative_tokens=k, **kw))


def tpot_ms(eng: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(ms per token after the first, tokens) of one request alone."""
    eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    first = None
    n = 0
    while eng.has_unfinished():
        for o in eng.step():
            n += len(o.new_token_ids)
            if first is None and o.new_token_ids:
                first, n = time.perf_counter(), 1
    t = time.perf_counter() - first
    return (t * 1e3 / (n - 1) if n > 1 else float("nan")), n


def batch_tps(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    t0 = time.perf_counter()
    out = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=True))
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - t0)


def chat_ids(eng: LLMEngine, text: str) -> list[int]:
    return eng.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            tokenize=True)


def load(args, method: str) -> LLMEngine:
    eng = engine_for(args.model, method, args.k)
    eng.generate([chat_ids(eng, "Say hello.")], SamplingParams(max_tokens=8))  # warm-up
    return eng


def run_round(args, engines: dict[str, LLMEngine], times: dict[str, dict[str, list[float]]],
              r: int) -> None:
    """One round: every prompt on every method in turn, then c32 on each. suffix forgets
    the outputs it saw before the round (else it would match the previous round's answer
    to the very same prompt)."""
    for eng in engines.values():
        forget = getattr(eng.speculator and eng.speculator.proposer, "forget", None)
        if forget is not None:
            forget()
    for group, prompts in (("grounded", GROUNDED), ("chat", CHAT)):
        for name, text in prompts.items():
            for method, eng in engines.items():
                ms, n = tpot_ms(eng, chat_ids(eng, text), args.max_tokens)
                times[method].setdefault(name, []).append(ms)
                print(f"  round {r} {method:>10} {group:>8} {name:>9}: {ms:6.1f} ms/token "
                      f"over {n} tokens", flush=True)
    for method, eng in engines.items():
        chat = [chat_ids(eng, t) for t in CHAT.values()]
        tps = batch_tps(eng, [chat[i % len(chat)] + [i + 1] for i in range(32)],
                        args.c32_tokens)
        times[method].setdefault("c32", []).append(tps)
        print(f"  round {r} {method:>10} c32: {tps:.1f} tok/s", flush=True)


def summary(method: str, eng: LLMEngine, runs: dict[str, list[float]]) -> dict:
    res: dict = {"method": method, **{k: statistics.median(v) for k, v in runs.items()}}
    if eng.speculator is not None:
        st = eng.speculator.counters.get(eng.speculator.proposer.name)
        res["rate"], res["length"] = st.acceptance_rate, st.mean_accepted_length
    eng.leak_check()
    return res


def report(rows: list[dict]) -> None:
    base = next((r for r in rows if r["method"] == "none"), None)
    names = [*GROUNDED, *CHAT]
    print("\n| method | " + " | ".join(names) + " | grounded speedup | chat speedup | "
          "c32 tok/s | acceptance | tokens/verify |")
    print("|---" * (len(names) + 6) + "|")
    for r in rows:
        cells = [f"{r[n]:.1f}" for n in names]
        sp = lambda group: (statistics.geometric_mean([base[n] / r[n] for n in group])  # noqa: E731
                            if base else float("nan"))
        print(f"| {r['method']} | " + " | ".join(cells) +
              f" | {sp(GROUNDED):.2f}x | {sp(CHAT):.2f}x | {r['c32']:.1f} | "
              f"{r.get('rate', 0):.1%} | {r.get('length', 0):.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--methods", default="none,ngram,suffix,self:8")
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--c32-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="passes over every prompt and "
                    "method; each figure is the median of its rounds")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(f"start: {load_note()}", flush=True)
    engines = {m: load(args, m) for m in args.methods.split(",")}
    noise = Noise().start()
    times: dict[str, dict[str, list[float]]] = {m: {} for m in engines}
    for r in range(1, args.rounds + 1):
        run_round(args, engines, times, r)
    report([summary(m, eng, times[m]) for m, eng in engines.items()])
    print(f"\nend: {load_note()}; {noise.report()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
