"""Decode tokens/s of every model family's test checkpoint (tests/models/families.py: 2-3
layers, width 64, fp32), ours against transformers in the same run, at batch 1 and 32.

Both sides get the same batch of equal-length random prompts and decode greedily. The
decode rate is the tokens generated after the first over the time a run of NEW tokens
takes beyond a run of 1 token (so prefill is excluded the same way on both sides). The
engine runs each family on its test attention backend (sdpa for all, which computes
windows and soft-caps), without the compiled step (MoE cannot compile; one setting for all). These
checkpoints are tiny, so the numbers measure per-step overhead, not FLOPs.

    python bench/families.py [--new 32] [--prompt 16] [--threads N]
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from core.sampling import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from tests.models.families import FAMILIES, build_checkpoint, load_reference, prompts  # noqa: E402

BATCHES = (1, 32)


def _best(run, repeats: int = 3) -> float:
    """Fastest of ``repeats`` wall times of run() (the host is shared and noisy)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return min(times)


def ours(path: Path, backend: str, batch: list[list[int]], new: int) -> float:
    eng = LLMEngine(EngineConfig.from_flat(
        model=str(path), dtype="float32", quantization="none", max_model_len=256,
        num_kv_blocks=1024, block_size=16, attention_backend=backend, compile=False,
        max_num_seqs=max(BATCHES)))

    def run(n: int) -> None:
        eng.generate(batch, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    run(new)  # warm up
    return len(batch) * (new - 1) / (_best(lambda: run(new)) - _best(lambda: run(1)))


def theirs(path: Path, batch: list[list[int]], new: int) -> float:
    model = load_reference(path)
    ids = torch.tensor(batch)

    def run(n: int) -> None:
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                           pad_token_id=0)

    run(new)
    return len(batch) * (new - 1) / (_best(lambda: run(new)) - _best(lambda: run(1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}; prompt {args.prompt} tokens, "
          f"{args.new} new; decode tok/s (ours / transformers)")
    print("| family | backend | " + " | ".join(f"batch {b}: ours | transformers | ratio"
                                              for b in BATCHES) + " |")
    print("|---|---|" + "---|---|---|" * len(BATCHES))
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in sorted(FAMILIES.items()):
            path = build_checkpoint(Path(tmp) / name, name)
            cells = []
            for b in BATCHES:
                batch = prompts(b, seed=b, low=args.prompt, high=args.prompt)
                a, h = ours(path, spec.backend, batch, args.new), theirs(path, batch, args.new)
                cells.append(f"{a:,.0f} | {h:,.0f} | {a / h:.1f}x")
            print(f"| {name} | {spec.backend} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
