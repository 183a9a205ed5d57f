"""Quality of the quantized paths: perplexity on a fixed text and greedy agreement.

* HF checkpoint (bf16; made from the GGUF with transformers when absent, as
  bench/vs_peers.py does): --quantization none (bf16) against int8 and int4.
  Targets for int8: greedy tokens equal bf16's on >= 90% of positions over 50 prompts
  x 64 tokens; perplexity within 1% of bf16.
  Agreement is printed free-running (two greedy runs side by side) and teacher-forced
  (the quantized model's greedy pick after the bf16 run's own prefix, per position).
* The GGUF: Q4_1 kept packed (every row through the int4 kernel) against the same
  weights dequantized to bf16 (--quantization none). Target: perplexity within 0.5%.

The fixed text: CPython's own documentation topics (``pydoc_data.topics``, the text
``help()`` shows), in sorted topic order, the first --ppl-tokens tokens scored in
windows of 512 tokens without overlap. Prompts for the greedy runs: the first 24
tokens of 50 of those topics. All runs in bf16, 2 threads.

    .venv/bin/python bench/quant_quality.py [--ppl-tokens 4096] [--prompts 50]
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from bench.vs_peers import HF_DIR, hf_dir_from_gguf  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from core.sampling import SamplingParams  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402

WINDOW = 512


def fixed_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def perplexity(eng: LLMEngine, ids: list[int]) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        chunk = ids[start:start + WINDOW + 1]
        table = eng.kv.pool.allocate(eng.kv.blocks_needed(len(chunk) - 1))
        try:
            logits = eng.runner.prompt_logits(chunk[:-1], table)  # [T, V] fp32
        finally:
            eng.kv.pool.free(table)
        logp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(chunk[1:])
        nll -= logp[torch.arange(len(target)), target].sum().item()
        count += len(target)
    return math.exp(nll / count)


def greedy(eng: LLMEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    return [c.token_ids for c in eng.generate(prompts, params)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Free-running: positions where two greedy runs emit the same token (after a first
    difference the two continuations usually part for good)."""
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / sum(len(r) for r in a)


def forced_agreement(eng: LLMEngine, prompts: list[list[int]], ref: list[list[int]]) -> float:
    """Teacher-forced: at each position of the reference's greedy continuation, does this
    engine's greedy choice, given the same prefix, equal the reference's token?"""
    same = total = 0
    for prompt, cont in zip(prompts, ref):
        ids = prompt + cont
        table = eng.kv.pool.allocate(eng.kv.blocks_needed(len(ids) - 1))
        try:
            logits = eng.runner.prompt_logits(ids[:-1], table)  # [T, V]
        finally:
            eng.kv.pool.free(table)
        picks = logits[len(prompt) - 1:].argmax(-1).tolist()
        same += sum(p == t for p, t in zip(picks, cont))
        total += len(cont)
    return same / total


def engine(model: str, quantization: str, packed_rows: int | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(model=model, dtype="bfloat16", quantization=quantization,
                                            quant_packed_max_rows=packed_rows, num_threads=2,
                                            max_model_len=1024, num_kv_blocks=2048, compile=False))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=str(default_model_path()))
    ap.add_argument("--hf-dir", type=Path, default=HF_DIR)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    hf = str(hf_dir_from_gguf(Path(args.gguf), args.hf_dir))
    text = fixed_text()
    from pydoc_data.topics import topics

    rows = []
    base = engine(hf, "none")
    ids = base.tokenizer.encode(text)[: args.ppl_tokens + 1]
    prompts = [base.tokenizer.encode(topics[k])[:24] for k in sorted(topics)[: args.prompts]]
    ref_ppl, ref_tokens = perplexity(base, ids), greedy(base, prompts, args.new_tokens)
    rows.append(("HF bf16, none", ref_ppl, None, None, None))
    del base
    for q in ("int8", "int4"):
        eng = engine(hf, q)
        ppl = perplexity(eng, ids)
        rows.append((f"HF bf16, {q}", ppl, ppl / ref_ppl - 1,
                     agreement(greedy(eng, prompts, args.new_tokens), ref_tokens),
                     forced_agreement(eng, prompts, ref_tokens)))
        del eng
    dense = engine(args.gguf, "none")
    g_ppl, g_tokens = perplexity(dense, ids), greedy(dense, prompts, args.new_tokens)
    rows.append(("GGUF Q4_1 dequantized to bf16", g_ppl, None, None, None))
    del dense
    packed = engine(args.gguf, "gguf", packed_rows=1 << 20)  # every row on the int4 kernel
    p_ppl = perplexity(packed, ids)
    rows.append(("GGUF Q4_1 kept packed", p_ppl, p_ppl / g_ppl - 1,
                 agreement(greedy(packed, prompts, args.new_tokens), g_tokens),
                 forced_agreement(packed, prompts, g_tokens)))

    print(f"\nperplexity over {len(ids) - 1} tokens of pydoc_data.topics (windows of {WINDOW}); "
          f"greedy agreement over {len(prompts)} prompts x {args.new_tokens} tokens")
    print("greedy = : free-running agreement; forced = : teacher-forced (same prefix)")
    print(f"{'run':32s} {'ppl':>8s} {'vs ref':>8s} {'greedy =':>9s} {'forced =':>9s}")
    for name, ppl, rel, agree, forced in rows:
        print(f"{name:32s} {ppl:8.3f} {'' if rel is None else f'{rel:+.2%}':>8s} "
              f"{'' if agree is None else f'{agree:.1%}':>9s} "
              f"{'' if forced is None else f'{forced:.1%}':>9s}")
    i8 = rows[1]
    print(f"\n  int8 ppl within 1% of bf16: {'OK' if abs(i8[2]) <= 0.01 else 'MISSED'} "
          f"({i8[2]:+.2%}); int8 greedy agreement >= 90%: free-running "
          f"{'OK' if i8[3] >= 0.9 else 'MISSED'} ({i8[3]:.1%}), teacher-forced "
          f"{'OK' if i8[4] >= 0.9 else 'MISSED'} ({i8[4]:.1%})")
    q4 = rows[-1]
    print(f"  Q4_1 packed ppl within 0.5% of dequantized: "
          f"{'OK' if abs(q4[2]) <= 0.005 else 'MISSED'} ({q4[2]:+.2%})")
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
