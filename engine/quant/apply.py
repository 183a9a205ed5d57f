"""Swap a loaded model's nn.Linear layers for QuantLinear ones (dense + packed)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from engine.layers.linear import move_forward_hooks
from engine.quant.base import QuantMethod, Source, get_method
from engine.native import simd_flags
from engine.quant.blocks import BLOCK_KERNEL, kernel_path
from engine.quant.linear import QuantLinear
from engine.quant.packed import UnpackableWeight
from engine.quant.select import choose_paths, default_cache

log = logging.getLogger(__name__)

SourceLookup = Callable[[str], Sequence[Source] | None]
"""Module path (``model.layers.0.self_attn.qkv_proj``) -> its checkpoint blocks, or None."""


@dataclass
class QuantReport:
    """What quantization did at load: exposed as ``ModelRunner.quant`` for logs and metrics."""

    method: str
    packed: dict[str, str] = field(default_factory=dict)
    """Module path -> what it holds (``int8``, ``Q4 as int4/g32``, ...)."""
    fallbacks: list[str] = field(default_factory=list)
    """Why each linear that should have been packed runs dense instead."""
    packed_bytes: int = 0
    dense_bytes: int = 0
    paths: dict[tuple, tuple] = field(default_factory=dict)
    """Measured {shape key: (packed_max_rows, [(rows, packed us, dense us)])}."""
    activation_fallbacks: list[str] = field(default_factory=list)
    """Why --activation-quant int8 is not running (its kernel cannot run on this CPU)."""


def unquantizable(model: nn.Module) -> str | None:
    """"arch: module path: why" for the first layer that declares ``not_quantizable``
    (the MoE experts: no packed kernel for their stacked weights), else None."""
    for path, mod in model.named_modules():
        reason = getattr(type(mod), "not_quantizable", None)
        if reason:
            return f"{getattr(model, 'architecture', type(model).__name__)}: {path}: {reason}"
    return None


def quantize_model(model: nn.Module, method_name: str, dtype: torch.dtype,
                   sources: SourceLookup, group_size: int = 32,
                   strict: bool = True) -> QuantReport:
    """Replace every nn.Linear (weights still fp32) with a QuantLinear whose dense copy
    holds the dequantized packed values (a tied embedding shares them).

    strict: an UnpackableWeight is an error naming the tensor and the flag (explicit
    int8/int4); otherwise the layer stays dense, logged and listed in ``fallbacks``. A
    model holding a layer that declares ``not_quantizable`` (the MoE experts) is refused,
    naming the layer and why."""
    method: QuantMethod = get_method(method_name, group_size)
    refusal = unquantizable(model)  # before any work: refuse, never half-pack
    if refusal:
        raise ValueError(f"--quantization {method_name}: {refusal}; serve it with "
                         "--quantization none")
    report = QuantReport(method_name)
    if next(model.parameters()).device.type == "cpu":  # the CPU's path, once per load
        line, reason = kernel_path()
        (log.info if reason is None else log.warning)(line)
    for path, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        shard = getattr(mod, "shard", None)  # a tensor-parallel rank's part of the weight
        try:
            found = sources(path)
            if shard is not None and found is not None:
                found = shard.sources(path + ".weight", found)
            packed, values = method.pack(path + ".weight", mod.weight.detach(), dtype,
                                         found, shard)
        except UnpackableWeight as e:
            if strict:
                raise ValueError(f"--quantization {method_name}: {e}") from e
            report.fallbacks.append(str(e))
            log.warning("quantization fallback: %s; this layer runs on dequantized weights", e)
            continue
        with torch.no_grad():  # a lossy method's quantized weights; a GGUF's own
            mod.weight.copy_(values)
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        swapped = QuantLinear(mod, packed, method.describe(packed))
        move_forward_hooks(mod, swapped)  # a tensor-parallel split's collective
        setattr(parent, attr, swapped)
        report.packed[path] = method.describe(packed)
        report.packed_bytes += packed.nbytes()
        report.dense_bytes += mod.weight.numel() * torch.empty((), dtype=dtype).element_size()
    return report


def select_paths(model: nn.Module, report: QuantReport, forced: int | None,
                 activation_quant: str = "none") -> None:
    """After the model is in its final dtype and device: choose how the packed weights see
    the activations (--activation-quant), then pick each layer's kernel by rows."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if activation_quant == "int8":
        set_int8_activations(layers, report)
    report.paths = choose_paths(layers, forced, default_cache())
    for (kind, n, k, g, dt, dev, layout), (rows, table) in report.paths.items():
        if not table:
            log.info("quant %s [%d,%d] %s: dense, not timed (no vectorised packed kernel "
                     "for this dtype on %s)", kind, n, k, dt, dev)
            continue
        cells = " ".join(f"M{m}:{tp:.0f}/{td:.0f}" for m, tp, td in table)
        int8 = any(m.activations == "int8" for m in layers if (m.out_features, m.in_features,
                                                                m.layout) == (n, k, layout))
        log.info("quant %s [%d,%d] %s: %s%s kernel up to %d rows (us packed/dense %s)", kind,
                 n, k, dt, layout, " x int8 activations" if int8 else "", rows, cells)


def set_int8_activations(layers: list[QuantLinear], report: QuantReport) -> None:
    """--activation-quant int8: the blocks-layout layers multiply activations quantized
    per 32 (tandem::block_mm_i8), where its kernel runs on this CPU; else every layer stays
    exact, with a warning and the reason in ``report.activation_fallbacks``."""
    blocks = [m for m in layers if m.layout == "blocks"]
    reason = BLOCK_KERNEL.unavailable() or (
        None if blocks else "no packed weight is in the blocks layout (GGUF blocks or "
                            "int8/int4 on a CPU without AVX-512 or in float32)")
    if reason is not None:
        report.activation_fallbacks.append(reason)
        log.warning("--activation-quant int8 unavailable (%s); packed weights multiply the "
                    "activations as they are (exact)", reason)
        return
    for m in blocks:
        m.activations = "int8"
    log.info("--activation-quant int8: %d of %d packed linears multiply activations quantized "
             "to int8 per 32 with AVX2 integer dot products (as llama.cpp does; CPU SIMD flags: "
             "%s)", len(blocks), len(layers), " ".join(simd_flags()))


def kernel_fallbacks(model: nn.Module, dtype: torch.dtype, device: torch.device
                     ) -> dict[str, list[str]]:
    """The weight kernels not running, by kind, for ``tandem:engine_fallbacks``:
    block_mm (the AVX2 block kernel, wherever packed weights are on a CPU) and int4_mm
    (int4 weights in bf16 left to aten's kernel: neither ours multiplies them)."""
    from engine.quant.packed import INT4_KERNEL

    out: dict[str, list[str]] = {"block_mm": [], "int4_mm": []}
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if device.type != "cpu" or not layers:
        return out
    if kernel_path()[1] is not None:
        out["block_mm"].append(kernel_path()[1])
    if (dtype == torch.bfloat16 and INT4_KERNEL.unavailable() is not None
            and any(m.kind == "int4" and m.layout == "aten" for m in layers)):
        out["int4_mm"].append(INT4_KERNEL.unavailable())
    return out
