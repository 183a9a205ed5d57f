"""Decode attention over the paged cache, without gathering the context first.

``paged_decode(q, kv, layer, tables, lens, scale)`` -> [N, Hq, D] for N sequences
with one query token each. On CPU it runs ``torch.ops.tandem.paged_decode``
(csrc/paged_decode.cpp): K and V rows are read in place through the block
tables, one (sequence, KV head) per task, so a step no longer copies every
context once per layer and the result of a row does not depend on the rest of
the batch. The extension is built on first use with the machine's compiler
(about 30 s, cached in torch's extension directory: ~/.cache/torch_extensions).

Elsewhere (CUDA, or no compiler) it falls back to a batched matmul-softmax-matmul
over the gathered blocks, and says so once in the log.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from engine.attention.base import gather_blocks

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_lock = threading.Lock()
_state: dict[str, str | None] = {}


def kernel_unavailable() -> str | None:
    """None when the CPU kernel is loaded (building it on first call), else why not."""
    with _lock:
        if "reason" not in _state:
            _state["reason"] = _build()
            if _state["reason"] is not None:
                log.warning("paged decode kernel unavailable (%s); decode attention gathers "
                            "the context and runs matmul-softmax-matmul", _state["reason"])
        return _state["reason"]


def _build() -> str | None:
    try:
        from torch.utils.cpp_extension import load

        load(name="tandem_paged_decode", sources=[str(_SOURCE)], is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
        torch.library.register_fake("tandem::paged_decode")(
            lambda q, kv, layer, tables, lens, scale: torch.empty_like(q))
    except Exception as e:  # no compiler, no headers: the fallback still works
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e) else ''}"
    return None


def paged_decode(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, Hq, D]; kv the whole cache; tables [N, maxb] long (padded with any block
    id); lens [N] long -> [N, Hq, D]."""
    if kv.device.type == "cpu" and kernel_unavailable() is None:
        return torch.ops.tandem.paged_decode(q.contiguous(), kv, layer, tables, lens, scale)
    return gathered_decode(q, kv, layer, tables, lens, scale)


def gathered_decode(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
                    lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The fallback: gather each context, then matmul-softmax-matmul with a length mask."""
    n, hq, d = q.shape
    ks, vs = gather_blocks(layer, kv, tables.reshape(-1))  # [N*maxb, B, Hkv, D]
    hkv = ks.shape[-2]
    ks = ks.view(n, -1, hkv, d).permute(0, 2, 3, 1)  # [N, Hkv, D, S]
    vs = vs.view(n, -1, hkv, d).transpose(1, 2)  # [N, Hkv, S, D]
    qg = q.view(n, hkv, hq // hkv, d)  # [N, Hkv, G, D]
    scores = torch.matmul(qg.float(), ks.float()) * scale  # [N, Hkv, G, S]
    keys = torch.arange(scores.shape[-1], device=q.device)
    scores = scores.masked_fill((keys >= lens[:, None])[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1), vs.float())  # [N, Hkv, G, D]
    return out.reshape(n, hq, d).to(q.dtype)
