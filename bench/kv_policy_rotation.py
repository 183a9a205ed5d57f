"""What positions within the cache cost under --kv-policy streaming (docs/performance.md).

Two ways to give attention positions within the cache, on the embedded model's KV shape
(30 layers, 3 KV heads, head_dim 64, blocks of 16), budget 512 (sinks=4,window=508: one
sink block, 31 recent): re-rotating the moved blocks' keys when a block is dropped (what
Tandem does: once per 16 tokens, the 30 held blocks after the sink) against rotating every
kept key at every read (once per token, 512 keys per layer). Prints ms per generated token.

    flock /tmp/tandem-cpu.lock python bench/kv_policy_rotation.py
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from engine.kv_cache.shift import shift_keys
from engine.layers.rotary import RotaryEmbedding

LAYERS, HKV, D, B, BUDGET = 30, 3, 64, 16, 512


def _model() -> SimpleNamespace:
    layer = SimpleNamespace(self_attn=SimpleNamespace(rope=0))
    return SimpleNamespace(model=SimpleNamespace(layers=[layer] * LAYERS,
                                                 rotaries=[RotaryEmbedding(D, 8192, 1e5, None)]))


def _ms(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    model = _model()
    rot = model.model.rotaries[0]
    for dtype in (torch.float32, torch.bfloat16):
        kv = torch.randn(64, LAYERS, 2, B, HKV, D).to(dtype)
        moved = list(range(1, BUDGET // B))  # the blocks after the sink block
        drop = _ms(lambda: shift_keys(kv, model, moved, -B, None), 20)
        keys = torch.randn(LAYERS, BUDGET, HKV, D).to(dtype)
        pos = torch.arange(BUDGET)
        cos, sin = rot.tables(pos, dtype)

        def read_time() -> None:
            for i in range(LAYERS):
                k = keys[i]
                _ = k * cos + torch.cat([-k[..., D // 2:], k[..., :D // 2]], -1) * sin

        read = _ms(read_time, 20)
        print(f"{str(dtype)[6:]:9s} re-rotate on drop: {drop:.3f} ms per drop = "
              f"{drop / B:.3f} ms/token | rotate at read: {read:.3f} ms/token")


if __name__ == "__main__":
    main()
