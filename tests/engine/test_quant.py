"""Packed weights: GGUF blocks map exactly onto the int4 kernel, the kernels agree with
the dequantized weights, bad shapes are named, and quantized engines stay batch-invariant."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.quant.base import get_method, resolve_method
from engine.quant.linear import QuantLinear
from engine.quant.packed import UnpackableWeight
from core.sampling import SamplingParams


def _w(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1])
def test_gguf_four_bit_blocks_pack_exactly(qtype) -> None:
    w = _w(64, 96).numpy()
    raw = quantize(w, qtype)  # [64, row bytes]
    want = torch.from_numpy(dequantize(raw, qtype).reshape(64, 96).astype(np.float32))
    packed, values = get_method("gguf").pack("w", want, torch.float32, [(qtype.name, raw)])
    torch.testing.assert_close(values, want, atol=1e-6, rtol=0)
    assert packed.kind == "int4" and packed.group_size == 32
    torch.testing.assert_close(packed.dequantize(), want, atol=1e-6, rtol=0)


def test_fused_shards_concatenate_in_order() -> None:
    a, b = _w(32, 64, 1).numpy(), _w(16, 64, 2).numpy()
    ra, rb = quantize(a, QT.Q4_1), quantize(b, QT.Q4_1)
    want = torch.from_numpy(np.concatenate([dequantize(ra, QT.Q4_1), dequantize(rb, QT.Q4_1)])
                            .reshape(48, 64).astype(np.float32))
    packed, _ = get_method("gguf").pack("qkv", want, torch.float32, [("Q4_1", ra), ("Q4_1", rb)])
    torch.testing.assert_close(packed.dequantize(), want, atol=1e-6, rtol=0)


def within_fp32_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                         bias: torch.Tensor | None = None) -> float:
    """max |y - (x @ w^T + bias)| over the bound of fp32 rounding, (K + 3) u (sum_k |x_k w_k|
    + |bias|) (u = 2^-24; K products summed, a scale and a min applied, the bias added): at
    most 1 when ``y`` is the exact product of ``w`` (plus ``bias``) up to fp32 rounding,
    whatever the order of the sums."""
    k = x.shape[1]
    ref = x.double() @ w.double().t()
    mag = x.double().abs() @ w.double().abs().t()
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    bound = (k + 3) * 2.0 ** -24 * mag + 1e-30
    return ((y.double() - ref).abs() / bound).max().item()


SHARDS = {"Q8_0": [QT.Q8_0], "Q4_0": [QT.Q4_0], "Q4_1": [QT.Q4_1],
          "mixed": [QT.Q4_1, QT.Q8_0, QT.Q4_0]}


@pytest.mark.parametrize("kernel", ["block_mm", "fallback"])
@pytest.mark.parametrize("shards", list(SHARDS))
def test_gguf_blocks_multiply_exactly(shards: str, kernel: str, monkeypatch) -> None:
    """A GGUF tensor kept packed multiplies by the file's own blocks: its dense copy is
    the gguf package's dequantization bit for bit, and its product is the exact one up
    to fp32 rounding (Q8_0 with its per-32 scales: requantized per channel it was 124x
    the bound). Without the block kernel (a CPU without AVX2) Q4 runs on aten's int4
    kernel, as exactly, and Q8_0 is unpackable: it runs on its exact dense copy."""
    from engine.quant import blocks

    if kernel == "fallback":
        monkeypatch.setattr(blocks.BLOCK_KERNEL, "unavailable", lambda: "no AVX2 (test)")
    elif blocks.BLOCK_KERNEL.unavailable() is not None:
        pytest.skip(f"block kernel: {blocks.BLOCK_KERNEL.unavailable()}")
    sources, parts = [], []
    for i, qt in enumerate(SHARDS[shards]):
        raw = quantize(_w(32 * (i + 1), 256, seed=i).numpy(), qt)
        sources.append((qt.name, raw))
        parts.append(dequantize(raw, qt).reshape(raw.shape[0], 256))
    want = torch.from_numpy(np.concatenate(parts).astype(np.float32))
    method = get_method("gguf")
    if kernel == "fallback" and shards in ("Q8_0", "mixed"):
        with pytest.raises(UnpackableWeight, match="w: GGUF Q8_0 blocks need the block "
                                                   r"kernel \(no AVX2 \(test\)\)"):
            method.pack("w", want, torch.float32, sources)
        return
    packed, values = method.pack("w", want, torch.float32, sources)
    assert torch.equal(values, want)  # the dense copy
    assert packed.layout == ("blocks" if kernel == "block_mm" else "aten")
    if packed.layout == "blocks":
        assert torch.equal(packed.dequantize(), want)
    for m in (1, 2, 3, 4, 5, 8, 33):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        assert within_fp32_rounding(packed.matmul(x), x, want) <= 1.0, m


def test_f16_is_unpackable() -> None:
    w = _w(32, 64)
    with pytest.raises(UnpackableWeight, match="lm_head: GGUF type F16 cannot be kept packed"):
        get_method("gguf").pack("lm_head", w, torch.float32, [("F16", np.zeros((32, 128), np.uint8))])


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_their_dequantized_weights(method: str, dtype: torch.dtype) -> None:
    w = _w(48, 128)
    packed, values = get_method(method).pack("w", w, dtype)
    deq = packed.dequantize().float()
    torch.testing.assert_close(deq, values.to(dtype).float(), atol=1e-6, rtol=1e-2)
    assert (deq - w).abs().max() <= (0.05 if method == "int4" else 0.005)
    x = torch.randn(5, 128, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(packed.matmul(x).float(), x.float() @ deq.t(), atol=tol, rtol=tol)


def _biased_layer(method: str, dtype: torch.dtype
                  ) -> tuple[QuantLinear, torch.Tensor, torch.Tensor]:
    """A biased nn.Linear [48, 128] packed by ``method`` as quantize_model does (the dense
    copy holds the method's values) -> (the QuantLinear, those values in fp32, the bias)."""
    dense = torch.nn.Linear(128, 48, bias=True)
    with torch.no_grad():
        dense.weight.copy_(_w(48, 128, seed=3))
        dense.bias.copy_(torch.randn(48, generator=torch.Generator().manual_seed(4)))
    sources = None
    if method == "gguf":  # a fused Q4_1 + Q8_0 weight, as a GGUF's q/k/v can be
        raws = [quantize(_w(32, 128, 5).numpy(), QT.Q4_1), quantize(_w(16, 128, 6).numpy(), QT.Q8_0)]
        sources = [("Q4_1", raws[0]), ("Q8_0", raws[1])]
        exact = np.concatenate([dequantize(raws[0], QT.Q4_1), dequantize(raws[1], QT.Q8_0)])
        with torch.no_grad():
            dense.weight.copy_(torch.from_numpy(exact.reshape(48, 128).astype(np.float32)))
    packed, values = get_method(method).pack("w", dense.weight.detach(), dtype, sources)
    with torch.no_grad():
        dense.weight.copy_(values)
    bias = dense.bias.detach().clone()
    return QuantLinear(dense.to(dtype), packed, method), values.float(), bias


@pytest.mark.parametrize("kernel", ["block_mm", "fallback"])
@pytest.mark.parametrize("method", ["int8", "int4", "gguf"])
def test_biased_linear_adds_its_bias_on_every_path(method: str, kernel: str, monkeypatch) -> None:
    """A biased layer, packed: the packed kernel (block_mm here, or aten's int8/int4 where
    the block kernel cannot run) and the dense copy both give x @ W^T + bias for the
    method's dequantized W, to fp32 rounding (Qwen2's q/k/v biases ran nowhere packed)."""
    from engine.quant import blocks

    if kernel == "fallback":
        if method == "gguf":
            pytest.skip("GGUF Q8_0 without the block kernel stays dense (unpackable)")
        monkeypatch.setattr(blocks.BLOCK_KERNEL, "unavailable", lambda: "no AVX2 (test)")
    elif blocks.BLOCK_KERNEL.unavailable() is not None:
        pytest.skip(f"block kernel: {blocks.BLOCK_KERNEL.unavailable()}")
    layer, values, bias = _biased_layer(method, torch.float32)
    assert layer.layout == ("blocks" if kernel == "block_mm" else "aten")
    for rows in (1, 3, 8):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        for packed_max_rows in (1 << 20, 0):  # the packed kernel, then the dense copy
            layer.packed_max_rows = packed_max_rows
            with torch.inference_mode():
                y = layer(x)
            assert within_fp32_rounding(y, x, values, bias) <= 1.0, (rows, packed_max_rows)


def test_biased_int4_on_the_avx512_kernel_adds_its_bias() -> None:
    """The AVX-512 int4 kernel (bf16, layout ``tiles``) adds the bias too, to bf16 rounding."""
    from engine.quant.packed import INT4_KERNEL

    if INT4_KERNEL.unavailable() is not None:
        pytest.skip(f"int4_mm: {INT4_KERNEL.unavailable()}")
    layer, _, bias = _biased_layer("int4", torch.bfloat16)
    assert layer.layout == "tiles"
    deq = layer.packed.dequantize().float()
    for rows in (1, 3, 8):
        x = torch.randn(rows, 128, dtype=torch.bfloat16)
        want = x.float() @ deq.t() + bias
        for packed_max_rows in (1 << 20, 0):
            layer.packed_max_rows = packed_max_rows
            with torch.inference_mode():
                y = layer(x).float()
            torch.testing.assert_close(y, want, atol=3e-2, rtol=3e-2)


def test_bad_shapes_name_the_tensor() -> None:
    with pytest.raises(UnpackableWeight, match=r"blk\.q \[40, 64\].*divisible by 16"):
        get_method("int4").pack("blk.q", _w(40, 64), torch.float32)
    with pytest.raises(UnpackableWeight, match=r"x \[16, 40\].*int8.*divisible by 16"):
        get_method("int8").pack("x", _w(16, 40), torch.float32)


def test_resolve_method() -> None:
    assert resolve_method("auto", is_gguf=True) == "gguf"
    assert resolve_method("auto", is_gguf=False) == "none"
    with pytest.raises(ValueError, match="--quantization gguf needs a .gguf"):
        resolve_method("gguf", is_gguf=False)
    with pytest.raises(ValueError, match="--quantization"):
        EngineConfig.from_flat(quantization="fp8")


def test_int4_on_unsupported_shape_is_a_clear_engine_error(tmp_path: Path) -> None:
    from tests.utils import make_tiny_llama

    d = make_tiny_llama(tmp_path / "odd", hidden=48, heads=4, kv_heads=2)  # K=48: no g32
    with pytest.raises(ValueError, match=r"--quantization int4: model\.layers\.0\.self_attn\.qkv_proj"):
        LLMEngine(EngineConfig.from_flat(model=str(d), dtype="float32", quantization="int4", num_kv_blocks=16))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_engine_is_batch_invariant(tiny_model_dir: Path, method: str) -> None:
    """Packed kernels at every batch size (forced): 8 requests together equal each alone."""
    eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32", quantization=method,
                                           quant_packed_max_rows=1 << 20, num_kv_blocks=128))
    layers = [m for m in eng.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 4 + 1 and eng.runner.fallbacks()["quantization"] == []
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + 3 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    together = [c.token_ids for c in eng.generate(prompts, params)]
    alone = [eng.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone
    eng.leak_check()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_tiny_matches_hf_with_the_same_weights(tiny_model_dir: Path, method: str) -> None:
    """On-load quantization against HF transformers holding the same quantized values:
    logits of every prompt position (dense path) and greedy tokens (packed kernels)."""
    transformers = pytest.importorskip("transformers")
    from tests.engine.test_reference_hf import hf_with_weights_of

    eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32", quantization=method,
                                           quant_packed_max_rows=4, num_kv_blocks=64))
    hf = hf_with_weights_of(transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32).eval(), eng.runner)
    ids = [(5 * j) % 300 + 3 for j in range(40)]
    table = eng.kv.pool.allocate(eng.kv.blocks_needed(len(ids)))
    ours = eng.runner.prompt_logits(ids, table)
    eng.kv.pool.free(table)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
    got = eng.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert got[0].token_ids == out[0, len(ids):].tolist()
    eng.leak_check()


def test_gguf_tensor_that_cannot_stay_packed_falls_back_with_a_log(caplog) -> None:
    import logging

    from torch import nn

    from engine.quant.apply import quantize_model

    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.Linear(32, 16, bias=False))
    raw = quantize(_w(32, 64).numpy(), QT.Q4_1)
    sources = {"0": [("Q4_1", raw)], "1": [("F16", np.zeros((16, 64), np.uint8))]}
    with caplog.at_level(logging.WARNING):
        report = quantize_model(model, "gguf", torch.float32, sources.get, strict=False)
    assert isinstance(model[0], QuantLinear) and isinstance(model[1], nn.Linear)
    assert report.fallbacks == ["1.weight: GGUF type F16 cannot be kept packed (packable: "
                                "Q4_0, Q4_1, Q8_0)"]
    assert "1.weight: GGUF type F16" in caplog.text and "dequantized" in caplog.text


def test_kernel_choice_is_timed_over_every_layer_of_a_shape(monkeypatch) -> None:
    """The packed-or-dense choice is timed the way a step runs: every layer of one shape
    in turn (weights streamed from memory), not one layer over and over (its weight hot
    in cache); one decision per shape, applied to all of its layers."""
    from engine.quant import select

    def layer(n: int) -> QuantLinear:
        dense = torch.nn.Linear(128, n, bias=False).bfloat16()
        packed, _ = get_method("int8").pack("w", dense.weight.float(), torch.bfloat16)
        return QuantLinear(dense, packed, "int8")

    layers = [layer(48) for _ in range(3)] + [layer(64)]
    calls = []
    orig = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, b=None: calls.append(id(w)) or orig(x, w, b))
    measured = select.choose_paths(layers, None)
    assert len(measured) == 2  # two shapes
    first_shape = {id(lr.weight) for lr in layers[:3]}
    assert first_shape <= set(calls)  # a dense pass touched each of the three layers
    assert len({lr.packed_max_rows for lr in layers[:3]}) == 1
    assert select.choose_paths(layers, 5) == {} and all(lr.packed_max_rows == 5 for lr in layers)


def test_a_clear_loss_ends_the_kernel_timing(monkeypatch) -> None:
    """A packed kernel 1.5x slower than the dense GEMM at one row is not timed at more
    rows (an fp32 start-up spent 4 s timing int kernels that lose 8-10x everywhere); a
    narrow loss is timed once more before the dense GEMM is chosen."""
    from engine.quant import select

    dense = torch.nn.Linear(64, 32, bias=False)
    packed, _ = get_method("int8").pack("w", dense.weight.float(), torch.float32)
    layers = [QuantLinear(dense, packed, "int8")]
    for packed_us, want_rows in ((10.0, [1]), (1.2, [1, 2])):
        monkeypatch.setattr(select, "_best_us", lambda packed, dense, t=packed_us: (t, 1.0))
        best, table = select.measure(layers)
        assert best == 0 and [m for m, _, _ in table] == want_rows


def test_a_burst_of_load_at_start_up_does_not_switch_the_packed_kernel_off() -> None:
    """Workers start side by side: the other's model loading once made the packed kernel
    time 7733 us at 2 rows against the dense GEMM's 898 (115 us alone), and the decode
    worker ran dense from 2 rows on. A loss is now timed again (the two in turn) before
    it counts; here the packed calls at 2 rows are slowed for the first eight of them."""
    from engine.quant import select

    out = torch.zeros(1, 1024)
    burst = {"left": 8}

    class Fast:  # a packed kernel far faster than the dense GEMM at every row count
        def matmul(self, x):
            if x.shape[0] == 2 and burst["left"] > 0:
                burst["left"] -= 1
                time.sleep(0.02)
            return out

    weight = torch.randn(1024, 1024)
    layer = SimpleNamespace(weight=weight, in_features=1024, packed_forward=Fast().matmul,
                            dense_forward=lambda x: torch.nn.functional.linear(x, weight))
    best, table = select.measure([layer])
    assert burst["left"] == 0 and best == select.ROWS[-1], table


def test_the_kernel_choice_is_kept_for_the_next_start(tmp_path, monkeypatch) -> None:
    """The row-count crossover is timed once per machine (17 of a worker's 27 s of start on
    the embedded GGUF): a second start reads it from the cache file; another layer count
    (a different pass) or a different thread count is timed anew, and a read-only cache
    only costs the timing."""
    from engine.quant import select

    def layers(n: int, count: int) -> list[QuantLinear]:
        out = []
        for _ in range(count):
            dense = torch.nn.Linear(128, n, bias=False).bfloat16()
            packed, _ = get_method("int8").pack("w", dense.weight.float(), torch.bfloat16)
            out.append(QuantLinear(dense, packed, "int8"))
        return out

    cache, timed = tmp_path / "kernel_paths.json", []
    monkeypatch.setattr(select, "measure", lambda group: timed.append(len(group)) or
                        (len(timed), [(1, 2.0, 3.0)]))
    monkeypatch.setattr(select, "UNDISTURBED", 0.0)  # an instant pass shows no CPU share
    first = layers(48, 3) + layers(64, 1)
    select.choose_paths(first, None, cache)
    assert timed == [3, 1] and [lr.packed_max_rows for lr in first] == [1, 1, 1, 2]
    again = layers(48, 3) + layers(64, 1)
    assert select.choose_paths(again, None, cache) == select.choose_paths(first, None, cache)
    assert timed == [3, 1] and [lr.packed_max_rows for lr in again] == [1, 1, 1, 2]
    select.choose_paths(layers(48, 2), None, cache)
    assert timed == [3, 1, 2]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        select.choose_paths(layers(64, 1), None, cache)
    finally:
        torch.set_num_threads(threads)
    assert timed == [3, 1, 2, 1]
    (tmp_path / "a-file").write_text("")  # a cache that cannot be written (even as root)
    select.choose_paths(layers(32, 1), None, tmp_path / "a-file" / "kernel_paths.json")
    assert timed == [3, 1, 2, 1, 1]


def test_a_kernel_timing_disturbed_by_another_process_is_not_kept(tmp_path, monkeypatch,
                                                                  caplog) -> None:
    """A timing pass whose threads did not get their CPU time (here: it sleeps, as a
    thread does while another process holds its core) is timed once more, and if that
    one is disturbed too its choice holds for this start only: the cache stays without
    it, so the next start times it again. Before, one start beside a test suite left
    a Q4_1 shape running dense at one row in kernel_paths.json for every later start."""
    from engine.quant import select

    dense = torch.nn.Linear(64, 32, bias=False)
    packed, _ = get_method("int8").pack("w", dense.weight.float(), torch.float32)
    cache, timed = tmp_path / "kernel_paths.json", []

    def starved(group):
        timed.append(len(group))
        time.sleep(0.05)  # wall time passes, no CPU time
        return 0, [(1, 9.0, 3.0)]

    monkeypatch.setattr(select, "measure", starved)
    layers = [QuantLinear(dense, packed, "int8")]
    with caplog.at_level(logging.WARNING, logger="engine.quant.select"):
        select.choose_paths(layers, None, cache)
    assert timed == [1, 1] and layers[0].packed_max_rows == 0
    assert not cache.exists()
    assert "disturbed twice" in caplog.text and "not kept" in caplog.text

    def busy(group):  # every thread of the pass busy for its whole wall time
        timed.append(len(group))
        return 4, [(1, 1.0, 3.0)]

    monkeypatch.setattr(select, "measure", busy)
    monkeypatch.setattr(select, "CpuShare", _FullShare)
    select.choose_paths(layers, None, cache)
    assert timed == [1, 1, 1] and layers[0].packed_max_rows == 4
    assert [v[0] for v in json.loads(cache.read_text()).values()] == [4]


class _FullShare:
    """CpuShare of a pass that got all its threads' time (what a quiet machine gives)."""

    def __init__(self, threads: int) -> None:
        self.share = 1.0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

