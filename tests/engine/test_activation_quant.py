"""--activation-quant int8 (issue 27): packed blocks times activations quantized to int8 per
32, as llama.cpp multiplies on a CPU (tandem::block_mm_i8). The kernel computes exactly the
product of the file's weights with the dequantized activation codes (up to fp32 summation
order); it runs only on request, falls back to the exact path where it cannot run, and
on the embedded model keeps the exact path's greedy tokens."""
from __future__ import annotations

import logging

import pytest
import torch

from core.sampling import SamplingParams
from engine import native
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.quant.apply import QuantReport, set_int8_activations
from engine.quant.blocks import BLOCK_KERNEL, block_values, pack_blocks
from engine.quant.linear import QuantLinear
from engine.quant.packed import pack_int8
from tests.utils import real_model_path


@pytest.fixture(scope="module")
def kernel() -> None:
    if BLOCK_KERNEL.unavailable() is not None:
        pytest.skip(f"block_mm_i8: {BLOCK_KERNEL.unavailable()}")


def torch_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] int8, scales [M, K/32]): per 32, d = max|x| / 127 and
    codes round(x / d), ties to even (the same fp32 operations as the kernel's)."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return torch.round(blocks * inv[..., None]).to(torch.int8).view_as(x), d


def weights(qtype: str, n: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks of a GGUF type: (codes, sm) as the blocks layout holds them."""
    d = torch.rand(n, k // group) * 0.02 + 0.001
    if qtype == "Q8_0":
        return pack_blocks(torch.randint(-128, 128, (n, k), dtype=torch.int8), d,
                           torch.zeros_like(d), group)
    m = -8 * d if qtype == "Q4_0" else torch.randn(n, k // group) * 0.05
    return pack_blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8), d, m, group)


@pytest.mark.parametrize("qtype,k,group", [("Q4_0", 352, 32), ("Q4_1", 352, 32),
                                           ("Q8_0", 352, 32), ("Q4_1", 384, 128),
                                           ("Q8_0", 352, 352)])
def test_int8_activation_product_equals_the_quantized_reference(kernel, qtype: str, k: int,
                                                                group: int) -> None:
    """K = 352 (11 blocks: not a multiple of 256), 37 outputs, 1, 3, 4 and 5 rows (the
    kernel's passes of 4 and their tails); groups of 32 (GGUF), 128 (int4) and the whole
    row (int8 per channel). Codes and scales equal torch's exactly; the product equals
    sum_k W[n, k] * d[m, k / 32] * q[m, k] in float64 within fp32 summation order."""
    torch.manual_seed(0)
    codes, sm = weights(qtype, 37, k, group)
    w = block_values(codes, sm, group).double()
    for rows in (1, 3, 4, 5):
        x = torch.randn(rows, k) * torch.rand(rows, k // 32).repeat_interleave(32, 1)
        x[0, :32] = 0  # an all-zero block: scale 0, codes 0
        q, d = torch_q8(x)
        got_q, got_d, got_s = torch.ops.tandem.quantize_act_q8(x)
        assert torch.equal(got_q, q) and torch.equal(got_d, d)
        assert torch.equal(got_s, q.view(rows, -1, 32).int().sum(-1))
        ref = (q.double().view(rows, -1, 32) * d.double()[..., None]).view(rows, k) @ w.T
        y = torch.ops.tandem.block_mm_i8(x, codes, sm, group)
        assert y.dtype == torch.float32 and y.shape == (rows, 37)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_without_avx2_the_flag_falls_back_to_the_exact_path(monkeypatch, caplog) -> None:
    """A CPU without AVX2 (the ``default`` ceiling): a warning names why, the reason is
    listed for tandem:engine_fallbacks{kind="activation_quant"}, and the layers multiply
    exactly."""
    packed = pack_int8(torch.randint(-127, 128, (64, 64), dtype=torch.int8),
                       torch.rand(64), torch.float32)
    layer = QuantLinear(torch.nn.Linear(64, 64, bias=False), packed, "int8")
    monkeypatch.setenv(native.CAPABILITY_ENV, "default")
    monkeypatch.setattr(BLOCK_KERNEL, "_tried", False)
    monkeypatch.setattr(BLOCK_KERNEL, "_reason", None)
    report = QuantReport("int8")
    with caplog.at_level(logging.WARNING, logger="engine.quant.apply"):
        set_int8_activations([layer], report)
    assert report.activation_fallbacks == ["this CPU lacks avx2, fma, f16c"]
    assert "--activation-quant int8 unavailable (this CPU lacks avx2, fma, f16c); packed " \
           "weights multiply the activations as they are (exact)" in caplog.text
    assert layer.activations == "none"


def test_the_flag_is_refused_without_packed_weights() -> None:
    with pytest.raises(ValueError, match="--activation-quant int8 multiplies packed weights, "
                                         "and --quantization none packs none"):
        EngineConfig.from_flat(quantization="none", activation_quant="int8")
    with pytest.raises(ValueError, match="--activation-quant must be one of none, int8; "
                                         "got 'int4'"):
        EngineConfig.from_flat(activation_quant="int4")


PROMPTS = [[1, 9690, 314, 253, 2330, 30], [504, 3575, 282, 4649, 314], [17, 28, 19, 28, 33, 45]]


def test_embedded_model_greedy_tokens_with_int8_activations(kernel) -> None:
    """The embedded GGUF with --activation-quant int8 gives the exact path's greedy tokens
    (decode steps of 3 rows on the packed kernels); the exact path is the same engine with
    its layers set back (one model load, not two)."""
    eng = LLMEngine(EngineConfig.from_flat(model=str(real_model_path()), dtype="float32",
                                           max_model_len=256, num_kv_blocks=64,
                                           quant_packed_max_rows=8, activation_quant="int8"))
    layers = [m for m in eng.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 121 and {m.activations for m in layers} == {"int8"}
    assert eng.runner.fallbacks()["activation_quant"] == []
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    int8 = [c.token_ids for c in eng.generate(PROMPTS, params)]
    for m in layers:
        m.activations = "none"
    assert int8 == [c.token_ids for c in eng.generate(PROMPTS, params)]
    eng.leak_check()
