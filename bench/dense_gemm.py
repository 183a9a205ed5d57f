"""The dense GEMMs of one decode step, plain weights (F.linear) against weights prepacked
for oneDNN (engine/layers/dense.py): the embedded model's four linear shapes per layer,
30 layers of distinct (cold) weights, per row count; median of 7 passes.

    python bench/dense_gemm.py [--dtype bfloat16|float32] [--rows 1,8,32,64,512]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from engine.layers import dense  # noqa: E402
from engine.native import simd_flags  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
"""(K, N) of SmolLM2-135M's qkv, o, gate_up and down projections."""


def _pass_ms(fn) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(7):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[3] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rows", default="1,8,32,64,512")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    reason = dense.unavailable(torch.empty(1, dtype=dt))
    if reason:
        print(f"no prepacked GEMM here: {reason}")
        return 1
    torch.manual_seed(0)
    weights = [[torch.randn(n, k, dtype=dt) for k, n in SHAPES] for _ in range(args.layers)]
    packed = [[dense.prepack(w) for w in ws] for ws in weights]
    flops_per_row = 2 * sum(k * n for k, n in SHAPES) * args.layers
    print(f"SIMD flags: {' '.join(simd_flags())}; {args.dtype}; {args.layers} layers x "
          f"{len(SHAPES)} GEMMs; torch threads {torch.get_num_threads()}")
    print("rows | plain ms | prepacked ms | speed-up")
    for m in map(int, args.rows.split(",")):
        xs = {k: torch.randn(m, k, dtype=dt) for k, _ in SHAPES}
        plain = _pass_ms(lambda: [F.linear(xs[w.shape[1]], w) for ws in weights for w in ws])
        pre = _pass_ms(lambda: [dense.linear(xs[k], p, None) for ps in packed
                                for (k, _), p in zip(SHAPES, ps)])
        print(f"{m} | {plain:.1f} ({flops_per_row * m / plain / 1e6:.0f} GFLOP/s) | "
              f"{pre:.1f} ({flops_per_row * m / pre / 1e6:.0f} GFLOP/s) | {plain / pre:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
