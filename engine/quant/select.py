"""Which kernel per row count: measured at start-up, once per distinct weight shape.

For each (kind, N, K, group, dtype) the packed kernel and the dense GEMM are timed
at 1, 2, 4, ... rows (the best of a few calls after a warm-up) until the dense
GEMM has won twice in a row; ``packed_max_rows`` is the largest row count up to
which the packed kernel won every time. In fp32 the CPU int kernels have no
vectorised path and lose at every size, so fp32 models run dense (with the
quantized values) unless ``quant_packed_max_rows`` forces the packed kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.quant.linear import QuantLinear
from engine.timing import best_seconds

ROWS = (1, 2, 4, 8, 16, 32, 64)


def _best_us(fn) -> float:
    return best_seconds(fn, reps=5, warmup=1) * 1e6


@torch.inference_mode()
def measure(layer: QuantLinear) -> tuple[int, list[tuple[int, float, float]]]:
    """-> (packed_max_rows, [(rows, packed us, dense us)])."""
    w, packed = layer.weight, layer.packed
    table: list[tuple[int, float, float]] = []
    best_rows, losses = 0, 0
    for m in ROWS:
        x = torch.randn(m, layer.in_features, dtype=w.dtype, device=w.device)
        tp = _best_us(lambda: packed.matmul(x))
        td = _best_us(lambda: F.linear(x, w))
        table.append((m, tp, td))
        if tp < td and losses == 0:
            best_rows = m
        else:
            losses += 1
            if losses == 2:
                break
    return best_rows, table


def choose_paths(layers: list[QuantLinear], forced: int | None) -> dict[tuple, tuple]:
    """Set every layer's packed_max_rows; returns {shape key: (rows, table)} measured."""
    measured: dict[tuple, tuple] = {}
    for layer in layers:
        if forced is not None:
            layer.packed_max_rows = forced
            continue
        key = (layer.kind, layer.out_features, layer.in_features, layer.group_size,
               layer.weight.dtype, layer.weight.device.type)
        if key not in measured:
            measured[key] = measure(layer)
        layer.packed_max_rows = measured[key][0]
    return measured
