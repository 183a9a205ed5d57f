"""Dense GEMMs on weights prepacked for oneDNN (engine/layers/dense.py): exact, used by
every linear on a CPU, traced by the compiled step, and off (with the reason logged and
exported) where oneDNN cannot take them."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from core.sampling import SamplingParams
from engine.compile.decode import cpu_options
from engine.config import EngineConfig
from engine.layers import dense
from engine.llm_engine import LLMEngine
from tests.engine.test_quant import within_fp32_rounding

BF16 = dense.unavailable(torch.empty(1, dtype=torch.bfloat16)) is None


def _w(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("rows", [1, 3, 32, 100])
def test_a_prepacked_weight_multiplies_as_the_plain_one(rows: int) -> None:
    """fp32: the exact product up to fp32 rounding (another order of sums than F.linear);
    bf16: F.linear's result bit for bit (oneDNN computes both)."""
    w, x, b = _w(160, 96, 0), _w(rows, 96, 1), _w(1, 160, 2)[0]
    for bias in (None, b):
        y = dense.linear(x, dense.prepack(w), bias)
        assert within_fp32_rounding(y, x, w, bias) <= 1.0
    if BF16:
        wb, xb = w.bfloat16(), x.bfloat16()
        assert torch.equal(dense.linear(xb, dense.prepack(wb), b.bfloat16()),
                           F.linear(xb, wb, b.bfloat16()))


def test_the_compiled_step_calls_the_prepacked_gemm() -> None:
    """Inductor lowers mkldnn's linear only for frozen weights; ours are graph inputs, so
    the call is a custom op, and a compiled graph gives the eager product."""
    w, x = _w(64, 32, 3), _w(8, 32, 4)
    packed = dense.prepack(w)
    step = torch.compile(lambda x, p: dense.linear(x, p, None) * 2, dynamic=False,
                         fullgraph=True, options=cpu_options())  # the width in the cache key
    assert torch.equal(step(x, packed), dense.linear(x, packed, None) * 2)


def _engine(model: Path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(model=str(model), dtype="float32",
                                            num_kv_blocks=64, max_model_len=256, **kw))


def _prepacked(eng: LLMEngine) -> tuple[int, int]:
    linears = [m for m in eng.runner.model.modules() if hasattr(m, "onednn_weight")]
    return sum(m.onednn_weight is not None for m in linears), len(linears)


def test_every_linear_runs_prepacked_and_gives_the_plain_logits(tiny_model_dir: Path) -> None:
    on, off = _engine(tiny_model_dir), _engine(tiny_model_dir, prepack_weights=False)
    done, total = _prepacked(on)
    assert done == total > 0 and _prepacked(off) == (0, total)
    assert on.runner.fallbacks()["prepack"] == []
    prompt = [5, 9, 31, 7, 2, 44, 13, 8]
    a = on.runner.prompt_logits(prompt, [1])
    b = off.runner.prompt_logits(prompt, [1])
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [prompt, [3, 4, 5], [60, 61, 62, 63, 64]]
    assert [c.token_ids for c in on.generate(prompts, params)] == \
        [c.token_ids for c in off.generate(prompts, params)]


def test_where_onednn_cannot_the_plain_weights_run_and_say_why(tiny_model_dir: Path,
                                                               monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        eng = _engine(tiny_model_dir)
    assert _prepacked(eng)[0] == 0
    assert eng.runner.fallbacks()["prepack"] == ["this torch build has no oneDNN"]
    assert "dense GEMMs run on plain weights (this torch build has no oneDNN)" in caplog.text
