"""Which matmul kernel is fastest at which batch size, on this machine: the weight-only
int8 and int4 kernels (ours where it builds, and PyTorch's: "int4 aten") against the
dense bf16 (and fp32) GEMM, for the embedded model's weight shapes, at 1 to 256 rows.
Each call multiplies one weight over and over (cached), unlike the engine's start-up
timing, which streams every layer's weight of a shape. The engine makes the same measurement at start-up
(engine/quant/select.py) and this prints it in full.

    .venv/bin/python bench/quant_kernels.py [--threads 2] [--rows 1,2,4,8,16,32,64,256]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from engine.quant.base import get_method  # noqa: E402
from engine.quant.packed import pack_int4  # noqa: E402
from engine.quant.quantize import int4_codes  # noqa: E402

# SmolLM2-135M: fused qkv, o, fused gate/up, down, the (tied) LM head. [N, K]
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def best_us(fn, budget_s: float = 0.2) -> float:
    fn()
    fn()
    best, n, t_end = float("inf"), 0, time.perf_counter() + budget_s
    while n < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best, n = min(best, time.perf_counter() - t0), n + 1
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"us per call, best of repeats, {args.threads} threads; * = fastest")
    kinds = ("bf16", "int8", "int4", "int4 aten")
    print(f"{'shape':16s} {'rows':>5s} " + " ".join(f"{c:>9s}" for c in kinds) + f" {'fp32':>9s}")
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k) * 0.05
            i8, _ = get_method("int8").pack(name, w, torch.bfloat16)
            i4, _ = get_method("int4").pack(name, w, torch.bfloat16)
            i4a = pack_int4(*int4_codes(w, 32), 32, torch.bfloat16, layout="aten")
            wb = w.bfloat16()
            for m in rows:
                x = torch.randn(m, k)
                xb = x.bfloat16()
                t = {"bf16": best_us(lambda: F.linear(xb, wb)),
                     "int8": best_us(lambda: i8.matmul(xb)),
                     "int4": best_us(lambda: i4.matmul(xb)),
                     "int4 aten": best_us(lambda: i4a.matmul(xb)),
                     "fp32": best_us(lambda: F.linear(x, w))}
                fastest = min(kinds, key=t.get)
                cells = " ".join(f"{t[c]:8.1f}{'*' if c == fastest else ' '}" for c in kinds)
                print(f"{name + f' [{n},{k}]':16s} {m:5d} {cells} {t['fp32']:8.1f}", flush=True)


if __name__ == "__main__":
    main()
