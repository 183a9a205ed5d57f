"""Re-rotating keys in place when a bounded KV policy moves blocks down its cache
(engine/kv_cache/policy.py): the KV manager says which blocks and by how much, the
runner calls this on the engine thread before any later read or copy of them."""
from __future__ import annotations

import torch

from engine.kv_cache.quant import decode, encode


@torch.inference_mode()
def shift_keys(kv: torch.Tensor, model: torch.nn.Module, blocks: list[int], delta: int,
               kv_quant: str | None) -> None:
    """Rotate the keys of ``blocks`` (every layer) from position p to p + delta, each
    layer through its own rotary (Gemma 3's local and global layers differ). A quantized
    cache is dequantized, rotated in fp32 and quantized again (K only; V has no position)."""
    decoder = model.model
    idx = torch.as_tensor(blocks, dtype=torch.long, device=kv.device)
    by_rope: dict[int, list[int]] = {}
    for i, layer in enumerate(decoder.layers):
        by_rope.setdefault(layer.self_attn.rope, []).append(i)
    for rope, layers in by_rope.items():
        lidx = torch.as_tensor(layers, dtype=torch.long, device=kv.device)
        at = (idx.view(-1, 1), lidx.view(1, -1), 0)
        keys = kv[at]  # [n, L', B, Hkv, row]
        d = keys.shape[-1] if kv_quant is None else None
        plain = keys if kv_quant is None else decode(keys, kv_quant, torch.float32)
        moved = decoder.rotaries[rope].shift(plain, delta)
        rows = moved.to(kv.dtype) if d is not None else encode(moved, kv_quant)
        kv[at] = rows
