"""Re-rotating keys in place when a bounded KV policy moves blocks down its cache
(engine/kv_cache/policy.py): the KV manager says which blocks and by how much, the
runner calls this on the engine thread before any later read or copy of them. H2O's
compaction (engine/kv_cache/h2o.py) rotates the keys it moves through ``rotated_keys``."""
from __future__ import annotations

import torch

from engine.kv_cache.quant import decode, encode


def rotated_keys(keys: torch.Tensor, model: torch.nn.Module, delta: int,
                 kv_quant: str | None, layer_dim: int) -> torch.Tensor:
    """Key rows (layers along ``layer_dim``, rows last) rotated from position p to
    p + delta, each layer through its own rotary (Gemma 3's local and global layers
    differ). A quantized cache is dequantized, rotated in fp32 and quantized again."""
    decoder = model.model
    by_rope: dict[int, list[int]] = {}
    for i, layer in enumerate(decoder.layers):
        by_rope.setdefault(layer.self_attn.rope, []).append(i)
    out = torch.empty_like(keys)
    for rope, layers in by_rope.items():
        lidx = torch.as_tensor(layers, dtype=torch.long, device=keys.device)
        part = keys.index_select(layer_dim, lidx)
        plain = part if kv_quant is None else decode(part, kv_quant, torch.float32)
        moved = decoder.rotaries[rope].shift(plain, delta)
        out.index_copy_(layer_dim, lidx,
                        moved.to(keys.dtype) if kv_quant is None else encode(moved, kv_quant))
    return out


@torch.inference_mode()
def shift_keys(kv: torch.Tensor, model: torch.nn.Module, blocks: list[int], delta: int,
               kv_quant: str | None) -> None:
    """Rotate the keys of ``blocks`` (every layer) from position p to p + delta (K only;
    V has no position)."""
    idx = torch.as_tensor(blocks, dtype=torch.long, device=kv.device)
    kv[idx, :, 0] = rotated_keys(kv[idx, :, 0], model, delta, kv_quant, layer_dim=1)
