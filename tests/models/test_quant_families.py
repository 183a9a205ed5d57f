"""--quantization int8/int4 on a family whose linears carry biases (Qwen2's q/k/v): the
packed layers add them, so the engine runs it (it used to refuse) and computes the model
whose linear weights are their quantized values.

The reference is our own engine with ``--quantization none`` on a copy of the checkpoint
whose linear weights are replaced by the method's dequantization (computed per tensor:
int8's scales are per output row and int4's groups lie along a row, so fusing q/k/v or
gate/up changes no value). With the packed kernels off (``quant_packed_max_rows=0``) the
quantized engine runs the very same F.linear calls on the very same values and biases, so
its tokens equal the reference's exactly, by construction, not to a tolerance. With the
packed kernels on for every row count the products differ from the dense ones only by
fp32 summation order (tests/engine/test_quant.py bounds that, bias included), far below
the greedy margins of these checkpoints (families.py), so the tokens equal too."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.quant.base import get_method
from engine.quant.linear import QuantLinear
from tests.models.families import prompts

NEW_TOKENS = 16


def _engine(path: Path, quantization: str, packed_max_rows: int | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(
        model=str(path), dtype="float32", quantization=quantization, max_model_len=256,
        num_kv_blocks=256, block_size=8, quant_packed_max_rows=packed_max_rows))


def _dequantized_copy(src: Path, dst: Path, method: str) -> Path:
    """src's checkpoint with every linear weight replaced by ``method``'s fp32 values."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tied = "lm_head.weight" not in tensors  # then the LM head packs the embedding's values
    quant = get_method(method)
    for name, t in tensors.items():
        linear = t.dim() == 2 and (tied or "embed_tokens" not in name)
        if linear:
            tensors[name] = quant.pack(name, t.float(), torch.float32)[1].contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _greedy(eng: LLMEngine, batch: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in eng.generate(batch, params)]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_qwen2_biases_run_quantized(checkpoint, tmp_path: Path, method: str) -> None:
    path = checkpoint("qwen2")
    batch = prompts(4, seed=5, low=3, high=40)
    want = _greedy(_engine(_dequantized_copy(path, tmp_path / method, method), "none"), batch)
    for packed_max_rows in (0, 1 << 20):  # dense copies (exact), then packed kernels
        eng = _engine(path, method, packed_max_rows)
        biased = [m for m in eng.runner.model.modules()
                  if isinstance(m, QuantLinear) and m.bias is not None]
        assert len(biased) == 2, "each layer's fused q/k/v packed with its bias"
        assert {m.packed_max_rows for m in biased} == {packed_max_rows}
        assert _greedy(eng, batch) == want, (method, packed_max_rows)
        eng.leak_check()
