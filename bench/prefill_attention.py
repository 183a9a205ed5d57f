"""Prefill attention of one layer, the in-place kernel (engine/attention/paged_prefill.py)
against the path it replaced on CPU (the context gathered from the paged cache, then
torch's SDPA): the embedded model's heads (9 query heads over 3 KV heads of 64), one
prompt of each length with no cached prefix; best of 5 passes of 5 calls, the two
alternated.

    python bench/prefill_attention.py [--dtype bfloat16|float32] [--lens 128,512,2048]
                                      [--fma-only]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from engine.attention import paged_prefill as pp  # noqa: E402
from engine.attention.base import LayerAttention, gather_kv, masked_attention  # noqa: E402
from engine.attention.paged_decode import kernel_unavailable  # noqa: E402
from engine.native import simd_flags  # noqa: E402

HQ, HKV, D, BLOCK = 9, 3, 64, 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--lens", default="128,512,2048")
    ap.add_argument("--fma-only", action="store_true",
                    help="bf16 on the kernel's fp32 panels, not its bf16 dot products")
    args = ap.parse_args()
    if kernel_unavailable():
        print(f"no attention kernel here: {kernel_unavailable()}")
        return 1
    dt = getattr(torch, args.dtype)
    params = LayerAttention(D ** -0.5)
    print(f"SIMD flags: {' '.join(simd_flags())}; {args.dtype}"
          f"{' on fp32 panels' if args.fma_only else ''}; torch threads "
          f"{torch.get_num_threads()}")
    print("prompt tokens | kernel ms | gathered + SDPA ms | speed-up")
    torch.manual_seed(0)
    for n in map(int, args.lens.split(",")):
        blocks = -(-n // BLOCK)
        kv = torch.randn(blocks + 1, 1, 2, BLOCK, HKV, D, dtype=dt)
        table = torch.arange(1, blocks + 1)
        q = torch.randn(n, HQ, D, dtype=dt)

        def kernel():
            return pp.paged_prefill(q, kv, 0, table, n, params, fma_only=args.fma_only)

        def gathered():
            ks, vs = gather_kv(0, kv, table.tolist(), n)
            return masked_attention(q.transpose(0, 1).unsqueeze(0),
                                    ks.transpose(0, 1).unsqueeze(0),
                                    vs.transpose(0, 1).unsqueeze(0), None, params)

        best = {kernel: float("inf"), gathered: float("inf")}
        for fn in best:
            fn()
        for _ in range(5):
            for fn in best:
                t = time.perf_counter()
                for _ in range(5):
                    fn()
                best[fn] = min(best[fn], (time.perf_counter() - t) / 5 * 1e3)
        flops = 4 * HQ * D * n * (n + 1) / 2  # q.k and p.v over the causal half
        k_ms, g_ms = best[kernel], best[gathered]
        print(f"{n} | {k_ms:.2f} ({flops / k_ms / 1e6:.0f} GFLOP/s) | "
              f"{g_ms:.2f} ({flops / g_ms / 1e6:.0f} GFLOP/s) | {g_ms / k_ms:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
