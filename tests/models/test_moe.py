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
from engine.models.base import compile_blocker

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.matmul.default, torch.ops.aten.linear.default,
           torch.ops.mkldnn._linear_pointwise.default}  # a prepacked linear (layers/dense.py)


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


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_decode_step_is_declared_uncompilable(checkpoint, family: str, caplog) -> None:
    """The experts' token split is data-dependent, so a full-graph compile cannot trace
    it: the model says so, and the runner skips compilation with one INFO line naming the
    reason (no ERROR), lists it as the compile fallback (tandem:engine_fallbacks), and
    decodes eagerly with the tokens an engine built with --no-compile gets."""
    from core.sampling import SamplingParams

    flags = dict(model=str(checkpoint(family)), dtype="float32", quantization="none",
                 max_model_len=128, num_kv_blocks=64, compile_max_batch=2)
    with caplog.at_level("INFO"):
        eng = LLMEngine(EngineConfig.from_flat(compile=True, **flags))
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    reason = compile_blocker(eng.runner.model)
    assert reason is not None and "data-dependent" in reason and family in reason
    said = [r for r in caplog.records if r.levelname == "INFO" and reason in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert eng.runner.fallbacks()["compile"] == [reason]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    batch = [[5, 6, 7, 8, 9], [11, 12, 13]]
    eager = LLMEngine(EngineConfig.from_flat(compile=False, **flags))
    assert ([c.token_ids for c in eng.generate(batch, params)]
            == [c.token_ids for c in eager.generate(batch, params)])
    eng.leak_check()


def test_dense_family_declares_no_blocker(checkpoint) -> None:
    from engine.models import MODELS
    from engine.loader import load_checkpoint

    ckpt = load_checkpoint(str(checkpoint("llama")))
    with torch.device("meta"):
        model = MODELS.load("llama")(ckpt.config, 64)
    assert compile_blocker(model) is None
