"""Decode attention of a batch over the paged cache, the in-place kernel
(engine/attention/paged_decode.py) on cold layers: the embedded model's heads (9 query
heads over 3 KV heads of 64, blocks of 16), ``--rows`` sequences of ``--ctx`` tokens each
on blocks in shuffled order, one call per layer over ``--layers`` layers of a
block-major cache (as a step reads it: each layer's K and V come from memory, not
cache); ms per layer, best of 7 timed passes, the paths alternated. The kernel's own paths (bf16 dot-product scores
where the CPU has AVX512_BF16, else fp32; ``fma_only``: the widened fp32 path) and the
gathered path (gather + SDPA) side by side.

    python bench/decode_attention.py [--rows 32] [--ctx 160] [--layers 30]
                                     [--dtype bfloat16|float32]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from engine.attention import paged_decode as pd  # noqa: E402
from engine.native import simd_flags  # noqa: E402

HQ, HKV, D, BLOCK = 9, 3, 64, 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=160)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args()
    if pd.kernel_unavailable():
        print(f"no attention kernel here: {pd.kernel_unavailable()}")
        return 1
    dt = getattr(torch, args.dtype)
    torch.manual_seed(0)
    per_row = -(-args.ctx // BLOCK)
    blocks = args.rows * per_row + 1
    kv = torch.randn(blocks, args.layers, 2, BLOCK, HKV, D, dtype=dt)
    tables = (torch.randperm(blocks - 1) + 1).view(args.rows, per_row)
    lens = torch.full((args.rows,), args.ctx, dtype=torch.long)
    q = torch.randn(args.rows, HQ, D, dtype=dt)
    mb = 2 * args.rows * args.ctx * HKV * D * kv.element_size() / 1e6
    print(f"SIMD flags: {' '.join(simd_flags())}; {args.dtype}; torch threads "
          f"{torch.get_num_threads()}; {args.rows} rows x {args.ctx} tokens, "
          f"{args.layers} layers, K and V {mb:.2f} MB a layer")
    paths = {
        "kernel": lambda layer: torch.ops.tandem.paged_decode(q, kv, layer, tables, lens,
                                                              D ** -0.5),
        "kernel, fma_only": lambda layer: torch.ops.tandem.paged_decode(
            q, kv, layer, tables, lens, D ** -0.5, fma_only=True),
        "gather + SDPA": lambda layer: pd.gathered_decode(q, kv, layer, tables, lens,
                                                          D ** -0.5),
    }
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(7):  # the paths alternated; each runs a pass over every layer, then the
        for name, fn in paths.items():  # timed one (after its own, not another's, traffic)
            for rep in range(2):
                t = time.perf_counter()
                for layer in range(args.layers):
                    fn(layer)
            best[name] = min(best[name], (time.perf_counter() - t) / args.layers * 1e3)
    print("path | ms a layer | GB/s of K and V")
    for name, ms in best.items():
        print(f"{name} | {ms:.3f} | {mb / ms:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
