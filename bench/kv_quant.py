"""int8 KV cache against bf16 KV on the same weights: quality, decode speed, capacity.

Everything runs in process on the embedded GGUF (Q4_1 kept packed, the default
``--quantization auto``), compute in bf16, 2 threads; only ``--kv-cache-dtype`` differs.

* quality (``--part quality``):
  - perplexity over the first --ppl-tokens tokens of CPython's documentation topics
    (``pydoc_data.topics`` in sorted order, as bench/quant_quality.py; windows of 512);
  - greedy agreement over --prompts prompts (the first 24 tokens of that many topics) x
    --new-tokens tokens, both free-running (two greedy runs side by side: after the first
    near-tie they part and share little) and teacher-forced (the int8 engine's greedy
    pick after the bf16 run's own prefix, at every position: per-token fidelity);
  - the floor of that free-running figure: the bf16-KV engine against itself with the
    same prompts in another batch arrangement (5 batches of 10): bf16 matmuls round
    differently per batch shape, so greedy runs part at near-ties with no KV change at
    all. With --fp32-agreement the agreement is also measured in fp32 compute (int8 KV
    against fp32 KV), where batch shape changes nothing and only the KV format differs;
  - long context: pass-key retrieval (the long-context papers' test): "The pass key is
    71432. Remember it. 71432 is the pass key." then ~--doc-tokens tokens of
    documentation (three different stretches of it), then "What is the pass key? The
    pass key is"; each greedy answer is checked for the number.
* speed (``--part speed``): decode tok/s at --context tokens of context, batch --batch
  (the in-place paged decode kernel serves up to 16 rows; int8 rows are dequantized in
  it). One --context prompt is prefilled and its blocks copied to every row, so each row
  reads its own memory; then --steps decode steps are timed (after 2 warm-up steps).
* capacity (``--part capacity``): --requests requests of 2,048-token prompts (distinct)
  and 64 output tokens on a pool of --capacity-gib GiB; the engine steps until the first
  preemption or the first finish, and the most requests running at once is printed.

    .venv/bin/python bench/kv_quant.py [--part all|quality|speed|capacity]

Prints numbers only; nothing here asserts timing.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from bench.quant_quality import agreement, fixed_text, forced_agreement, greedy, perplexity  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from core.kv import blocks_for  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from core.sampling import SamplingParams  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402

KV_DTYPES = ("bfloat16", "int8")
FACT = ("There is an important pass key hidden in this text. The pass key is 71432. "
        "Remember it. 71432 is the pass key.")
QUESTION = "What is the pass key? The pass key is"
ANSWER = "71432"
FILLERS = (20000, 60000, 100000)
"""Where in the documentation text each long-context document's filler starts."""


def engine(args, kv_dtype: str, **kw) -> LLMEngine:
    base = dict(model=args.model, dtype="bfloat16", kv_cache_dtype=kv_dtype, num_threads=2,
                compile=args.compile)
    base.update(kw)
    return LLMEngine(EngineConfig.from_flat(**base))


def long_context_prompt(eng: LLMEngine, doc_tokens: int, offset: int) -> list[int]:
    """The pass key, ~doc_tokens of documentation from ``offset`` on, then the question
    with its answer begun (a completion: the 135M model does not follow the chat
    template's question at this length)."""
    tok = eng.tokenizer
    filler = tok.decode(tok.encode(fixed_text()[offset:])[:doc_tokens])
    return tok.encode(f"{FACT}\n\n{filler}\n\n{QUESTION}")


def quality(args) -> None:
    from pydoc_data.topics import topics

    rows, ref = {}, None
    for kv_dtype in KV_DTYPES:
        eng = engine(args, kv_dtype, max_model_len=2560, num_kv_blocks=4096)
        ids = eng.tokenizer.encode(fixed_text())[: args.ppl_tokens + 1]
        prompts = [eng.tokenizer.encode(topics[k])[:24] for k in sorted(topics)[: args.prompts]]
        ppl = perplexity(eng, ids)
        toks = greedy(eng, prompts, args.new_tokens)
        answers = []
        for offset in FILLERS:
            lc = long_context_prompt(eng, args.doc_tokens, offset)
            answers.append((len(lc), eng.tokenizer.decode(greedy(eng, [lc], 8)[0])))
        row = {"ppl": ppl, "answers": answers}
        if ref is None:
            ref = (ppl, toks, prompts)
            row["floor"] = agreement(rearranged(eng, prompts, args.new_tokens), toks)
        else:
            row["free"] = agreement(toks, ref[1])
            row["forced"] = forced_agreement(eng, ref[2], ref[1])
            row["rel"] = ppl / ref[0] - 1
        rows[kv_dtype] = row
        del eng
    print(f"\nquality: perplexity over {args.ppl_tokens} tokens of pydoc_data.topics; greedy "
          f"agreement with bf16 KV over {args.prompts} prompts x {args.new_tokens} tokens")
    for name, r in rows.items():
        extra = (f"  vs bf16 {r['rel']:+.2%}; greedy equal: free-running {r['free']:.1%}, "
                 f"teacher-forced {r['forced']:.1%}" if "rel" in r else
                 f"  (bf16 against itself, other batches: free-running {r['floor']:.1%})")
        print(f"  KV {name:9s} ppl {r['ppl']:.3f}{extra}")
    for name, r in rows.items():
        for offset, (n, answer) in zip(FILLERS, r["answers"]):
            ok = ANSWER in answer
            print(f"  pass key at {n} prompt tokens (filler from {offset}), KV {name}: "
                  f"{'RIGHT' if ok else 'WRONG'}: {answer!r}")
    if args.fp32_agreement:
        fp32_agreement(args, prompts)


def rearranged(eng: LLMEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    """The same greedy runs with the prompts in batches of 10 instead of all at once."""
    return [t for i in range(0, len(prompts), 10) for t in greedy(eng, prompts[i:i + 10], new)]


def fp32_agreement(args, prompts: list[list[int]]) -> None:
    """int8 KV against fp32 KV with fp32 compute: only the KV format differs."""
    ref_eng = engine(args, "auto", dtype="float32", max_model_len=2560, num_kv_blocks=4096)
    ref = greedy(ref_eng, prompts, args.new_tokens)
    floor = agreement(rearranged(ref_eng, prompts, args.new_tokens), ref)
    del ref_eng
    eng = engine(args, "int8", dtype="float32", max_model_len=2560, num_kv_blocks=4096)
    free = agreement(greedy(eng, prompts, args.new_tokens), ref)
    forced = forced_agreement(eng, prompts, ref)
    print(f"  fp32 compute: int8 KV against fp32 KV: free-running {free:.1%}, teacher-forced "
          f"{forced:.1%} (fp32 KV against itself, other batches: {floor:.1%})")


def decode_speed(args, kv_dtype: str) -> float:
    per = blocks_for(args.context + args.steps + 4, 16)
    eng = engine(args, kv_dtype, num_kv_blocks=args.batch * per, max_num_seqs=args.batch,
                 max_model_len=args.context + args.steps + 8, compile_max_batch=args.batch)
    run = eng.runner
    prompt = (eng.tokenizer.encode(fixed_text()) * 2)[: args.context]
    params = SamplingParams(max_tokens=args.steps + 4, temperature=0, ignore_eos=True)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(args.batch)]
    first = eng.make_request(prompt, params)
    out = run.execute([(first, args.context)], tables[:1])
    filled = blocks_for(args.context, 16)
    src = run.kv[tables[0][:filled]]
    reqs = []
    for t in tables:
        run.kv[t[:filled]] = src  # each row reads its own copy of the context
        r = eng.make_request(prompt, params)
        r.token_ids.append(out.tokens[0][0])
        r.num_computed_tokens = args.context
        reqs.append(r)
    t0 = 0.0
    for step in range(args.steps + 2):
        if step == 2:
            t0 = time.perf_counter()
        got = run.execute([(r, 1) for r in reqs], tables)
        for r, toks in zip(got.requests, got.tokens):
            r.token_ids.append(toks[0])
            r.num_computed_tokens += 1
    return args.batch * args.steps / (time.perf_counter() - t0)


def speed(args) -> None:
    got = {d: decode_speed(args, d) for d in KV_DTYPES}
    print(f"\nspeed: decode at {args.context} tokens of context, batch {args.batch}, "
          f"{args.steps} steps, compile={'on' if args.compile else 'off'}")
    for d, tps in got.items():
        print(f"  KV {d:9s} {tps:7.1f} tok/s")
    print(f"  int8 / bf16: {got['int8'] / got['bfloat16']:.2f}x")


def capacity_run(args, kv_dtype: str) -> tuple[int, int, int]:
    """(pool blocks, most requests running at once before the first preemption or first
    finish, preemptions seen)."""
    eng = engine(args, kv_dtype, kv_cache_memory_gib=args.capacity_gib, max_model_len=2048 + 80,
                 max_num_batched_tokens=2048)
    ids = eng.tokenizer.encode(fixed_text())
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(args.requests):
        eng.add_request(ids[i * 2048:(i + 1) * 2048], params)
    most = 0
    while eng.has_unfinished():
        outs = eng.step()
        most = max(most, len(eng.scheduler.running))
        if sum(eng.stats.preemptions.values()) or any(o.finished for o in outs):
            break
    return eng.runner.num_blocks, most, sum(eng.stats.preemptions.values())


def capacity(args) -> None:
    got = {d: capacity_run(args, d) for d in KV_DTYPES}
    print(f"\ncapacity: {args.requests} requests of 2,048-token prompts + 64 new tokens, "
          f"--kv-cache-memory-gib {args.capacity_gib}")
    for d, (blocks, most, pre) in got.items():
        print(f"  KV {d:9s} {blocks} blocks ({blocks * 16} tokens); {most} requests ran at once "
              f"before the first preemption or finish ({pre} preemptions)")
    print(f"  tokens int8 / bf16: {got['int8'][0] / got['bfloat16'][0]:.3f}x; requests "
          f"{got['int8'][1]} vs {got['bfloat16'][1]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="all", choices=("all", "quality", "speed", "capacity"))
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=1900)
    ap.add_argument("--fp32-agreement", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure agreement in fp32 compute (about 4 more minutes)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--capacity-gib", type=float, default=0.2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    for part, fn in (("quality", quality), ("speed", speed), ("capacity", capacity)):
        if args.part in ("all", part):
            fn(args)
    print(f"\nload average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
          f"total {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
