"""The default path computes the file's weights (issue 27, "exact by default").

With no --quantization flag a GGUF is kept packed, and that path must multiply by
exactly what the file stores: every dense copy is the `gguf` package's dequantization
of the file, bit for bit (the products: tests/engine/test_quant.py; greedy tokens
against HF's on the default path: tests/engine/test_reference_hf.py). Before the fix
the Q8_0 tied embedding was requantized per channel to int8 and its "dense" copy made
from that approximation (7.7e-3 off the file).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader.gguf_loader import load_gguf, raw_rows
from engine.models.llama import checkpoint_names
from engine.quant.linear import QuantLinear

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_eng(model_path: Path) -> LLMEngine:
    """The default quantization (auto: the GGUF kept packed), in fp32 as HF runs."""
    if model_path.is_dir():
        pytest.skip("needs the GGUF")
    return LLMEngine(EngineConfig.from_flat(model=str(model_path), dtype="float32",
                                            max_model_len=1024, num_kv_blocks=256))


def test_every_dense_copy_is_the_files_exact_dequantization(default_eng: LLMEngine,
                                                           model_path: Path) -> None:
    runner = default_eng.runner
    assert runner.quant is not None and runner.quant.method == "gguf"
    ckpt = load_gguf(model_path)
    lookup = raw_rows(ckpt.reader, ckpt.config, ckpt.path)
    tie = runner.model_config.tie_word_embeddings
    checked, wrong = 0, []
    for path, mod in runner.model.named_modules():
        if not isinstance(mod, QuantLinear):
            continue
        parts = []
        for name in checkpoint_names(path, tie):
            type_name, rows = lookup(name)
            parts.append(dequantize(rows, QT[type_name]).reshape(rows.shape[0], -1))
        want = torch.from_numpy(np.concatenate(parts).astype(np.float32))
        if not torch.equal(mod.weight.detach(), want):
            wrong.append(f"{path}: max |dense - file| "
                         f"{(mod.weight.detach() - want).abs().max().item():.3e}")
        checked += 1
    assert checked == 30 * 4 + 1, checked
    assert not wrong, "dense copies that are not the file's weights:\n" + "\n".join(wrong[:8])
    embed = runner.model.model.embed_tokens.weight
    assert embed.data_ptr() == runner.model.lm_head.weight.data_ptr()  # still tied
