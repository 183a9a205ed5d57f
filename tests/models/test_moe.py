"""The MoE block runs each active expert as one grouped matmul pair over the tokens
routed to it (never a loop over tokens or over idle experts), and computes what a
per-token loop over each token's top-k experts computes."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config import EngineConfig
from engine.layers.activation import gated
from engine.llm_engine import LLMEngine

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.matmul.default, torch.ops.aten.linear.default}


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe(request, checkpoint):
    eng = LLMEngine(EngineConfig.from_flat(model=str(checkpoint(request.param)), dtype="float32",
                                           quantization="none", max_model_len=128, num_kv_blocks=64))
    return eng.runner.model.model.layers[0].mlp


def _per_token(moe, x: torch.Tensor) -> torch.Tensor:
    """The reference: each token through each of its top-k experts, one at a time."""
    probs = moe.gate(x).float().softmax(-1)
    weights, ids = probs.topk(moe.top_k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    ex = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = gated(x[t] @ ex.gate_up[e].T, ex.act)
            out[t] += w * (h @ ex.down[e].T)
    return out


@pytest.mark.parametrize("rows", [1, 32])
def test_one_grouped_matmul_per_active_expert(moe, rows: int) -> None:
    x = torch.randn(rows, moe.gate.in_features, generator=torch.Generator().manual_seed(rows))
    active = moe.gate(x).float().topk(moe.top_k, dim=-1).indices.unique().numel()
    with torch.inference_mode(), CountMatmuls() as counter:
        y = moe(x)
    # the router, then gate/up and down once for each expert some token chose
    assert counter.count == 1 + 2 * active, (counter.count, active)
    assert rows == 1 and active == moe.top_k or rows == 32 and active == moe.experts.num_experts
    with torch.inference_mode():
        torch.testing.assert_close(y, _per_token(moe, x), rtol=1e-5, atol=1e-5)
