"""Where a decode step's time goes: torch.profiler over eager decode steps at a batch size,
operators by self CPU time, plus the start-up table of packed vs dense kernel times.

Eager (not compiled) so each operator shows: the weight kernels (tandem::block_mm,
tandem::int4_mm, aten::mm/addmm for the dense GEMMs), attention, norms and the rest.

    python bench/decode_profile.py [--batch 1] [--steps 16] [--dtype auto] [--quantization auto]
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from core.sampling import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.native import simd_flags  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--rows", type=int, default=25, help="operators printed")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), "?")
    print(f"CPU: {cpu}; SIMD flags: {' '.join(simd_flags())}; torch threads "
          f"{torch.get_num_threads()}")
    eng = LLMEngine(EngineConfig.from_flat(model=args.model, dtype=args.dtype,
                                           quantization=args.quantization, compile=False,
                                           num_kv_blocks=256, max_model_len=1024))
    prompts = [[(11 * i + j) % 2000 + 10 for j in range(128)] for i in range(args.batch)]
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.generate(prompts, warm)
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.generate(prompts, params)  # one prefill step, then args.steps decode steps
    print(f"\nbatch {args.batch}: {args.steps} decode steps (+1 prefill), by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
