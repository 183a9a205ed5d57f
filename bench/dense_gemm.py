"""The dense GEMMs of one decode step, plain weights (F.linear) against weights prepacked
for oneDNN (engine/layers/dense.py): the embedded model's four linear shapes per layer,
30 layers of distinct (cold) weights, per row count; median of 7 passes. With --int4
(bf16, a CPU with AVX-512 BF16), the same weights as int4 groups of 32 (the embedded
GGUF's Q4 layers) through tandem::int4_mm too: its FMA path, its vdpbf16ps path
(INT4_DOT_MIN_ROWS rows and up without AMX) and, where the CPU has AMX, its AMX path.

    python bench/dense_gemm.py [--dtype bfloat16|float32] [--rows 1,8,32,64,512] [--int4]
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
from engine.quant import packed as pk  # noqa: E402
from engine.quant.quantize import int4_codes  # noqa: E402

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
    ap.add_argument("--int4", action="store_true",
                    help="also tandem::int4_mm over the weights as int4/g32 (bf16 only)")
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
    int4 = _int4_weights(weights, dt) if args.int4 else None
    paths = _int4_paths() if int4 else {}
    print("rows | plain ms | prepacked ms | speed-up"
          + "".join(f" | int4 {name} ms" for name in paths))
    for m in map(int, args.rows.split(",")):
        xs = {k: torch.randn(m, k, dtype=dt) for k, _ in SHAPES}
        plain = _pass_ms(lambda: [F.linear(xs[w.shape[1]], w) for ws in weights for w in ws])
        pre = _pass_ms(lambda: [dense.linear(xs[k], p, None) for ps in packed
                                for (k, _), p in zip(SHAPES, ps)])
        row = (f"{m} | {plain:.1f} ({flops_per_row * m / plain / 1e6:.0f} GFLOP/s) | "
               f"{pre:.1f} ({flops_per_row * m / pre / 1e6:.0f} GFLOP/s) | {plain / pre:.2f}x")
        for amx, dot in paths.values():
            ms = _pass_ms(lambda: [torch.ops.tandem.int4_mm(xs[k], w.data, w.scales, 32, amx, dot)
                                   for ws in int4 for (k, _), w in zip(SHAPES, ws)])
            row += f" | {ms:.1f} ({flops_per_row * m / ms / 1e6:.0f} GFLOP/s)"
        print(row)
    return 0


def _int4_weights(weights: list[list[torch.Tensor]], dt: torch.dtype) -> list[list]:
    """Each weight as int4 groups of 32 in the tiles layout (tandem::int4_mm's)."""
    if dt != torch.bfloat16 or pk.INT4_KERNEL.unavailable() is not None:
        sys.exit(f"--int4: no int4 tiles kernel here ({pk.INT4_KERNEL.unavailable() or 'bf16 only'})")
    return [[pk.pack_int4(*int4_codes(w, 32), 32, dt, layout="tiles") for w in ws]
            for ws in weights]


def _int4_paths() -> dict[str, tuple[int, int]]:
    """tandem::int4_mm's paths by name -> (amx_min_rows, dot_min_rows) that force each."""
    never = 1 << 30
    paths = {"FMA": (never, never), "vdpbf16ps": (never, 1)}
    if pk.amx_min_rows() < never:
        paths["AMX"] = (1, never)
    return paths


if __name__ == "__main__":
    sys.exit(main())
