"""Decode step time at batch 32 with 0, 1, 4 and 8 distinct LoRA adapters in the batch,
against the base model alone (an engine without LoRA), on the embedded model.

Adapters are random PEFT-format files (rank --rank on every linear, nonzero B) written
to a temporary directory. One engine serves them with --max-loras 8; another runs the
base only. Each case admits 32 requests (a --prompt-token prompt each), runs the prefill
step, then times --steps pure decode steps one by one and reports the median (the host is
shared and noisy). Both engines run eagerly (--no-compile: compiling batch sizes up to 32
twice costs minutes on a small host; the LoRA path compiles too, tests/models/test_lora.py).

    python bench/lora.py [--rank 16] [--steps 24] [--prompt 16] [--dtype auto]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from core.sampling import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.lora.layers import LoRALinear  # noqa: E402

BATCH = 32
CASES = (0, 1, 4, 8)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(root: Path, eng: LLMEngine, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory for every linear of eng's model (shapes read from it)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, target in eng.runner.lora_targets.items():
        for name, rows in target.shards:
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, target.in_features, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows.stop - rows.start, rank, generator=g) * 0.01
    root.mkdir(parents=True)
    save_file(tensors, str(root / "adapter_model.safetensors"))
    (root / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}))
    return root


def step_ms(eng: LLMEngine, names: list[str], prompt: int, steps: int) -> float:
    """Median decode step time (ms) of a batch of 32 requests under ``names``."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(BATCH):
        eng.add_request([100 + (i * 7 + j) % 1000 for j in range(prompt)], params,
                        lora=names[i % len(names)] if names else "")
    eng.step()  # the prefill step
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t) * 1e3)
    while eng.has_unfinished():
        eng.step()
    eng.leak_check()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=os.environ.get("TANDEM_MODEL", str(
        Path.home() / ".cache" / "tandem" / "SmolLM2-135M-Instruct.Q4_1.gguf")))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    common = dict(model=args.model, dtype=args.dtype, max_num_seqs=BATCH, num_kv_blocks=512, compile=False)
    base = LLMEngine(EngineConfig.from_flat(**common))
    tmp = Path(tempfile.mkdtemp())
    mods = tuple(f"l{i}={write_adapter(tmp / f'l{i}', base, args.rank, i)}" for i in range(8))
    lora = LLMEngine(EngineConfig.from_flat(**common, lora_modules=mods, max_loras=8,
                                            max_lora_rank=args.rank))
    n = sum(isinstance(m, LoRALinear) for m in lora.runner.model.modules())
    base_ms = step_ms(base, [], args.prompt, args.steps)
    print(f"embedded model, {lora.runner.dtype}, {torch.get_num_threads()} threads, batch "
          f"{BATCH}, rank {args.rank} on {n} linears, --max-loras 8, eager, median of "
          f"{args.steps} decode steps")
    print("| adapters in the batch | step ms | tok/s | vs base alone |\n|---|---|---|---|")
    print(f"| base alone (no LoRA engine) | {base_ms:.1f} | {BATCH * 1e3 / base_ms:.0f} | 1.00x |")
    for k in CASES:
        ms = step_ms(lora, [f"l{i}" for i in range(k)], args.prompt, args.steps)
        print(f"| {k} | {ms:.1f} | {BATCH * 1e3 / ms:.0f} | {ms / base_ms:.2f}x |")


if __name__ == "__main__":
    main()
