"""Which kernel per row count: measured at start-up, once per distinct weight shape.

For each (kind, N, K, group, dtype) the packed kernel and the dense GEMM are timed
at 1, 2, 4, ... rows (the best of a few calls after a warm-up, the two in turn, and a
loss timed again before it counts: workers start side by side, and a burst of the
other's model loading once made the packed kernel "lose" at 2 rows, 7733 us against
898) until the dense GEMM has won twice in a row, or once by a clear margin (``CLEAR_LOSS``);
``packed_max_rows`` is the largest row count up to which the packed kernel won
every time. Each timed call runs every layer of that shape in turn, as a model step
does: timing one layer over and over would keep its weight in cache, where the dense
GEMM's 2-4x more bytes cost nothing. With the weights streamed from memory (on the
embedded model, 30 layers of each shape) the packed kernels keep winning to about
twice the rows. In fp32 aten's CPU int kernels have no vectorised path and lose 8-10x at
every size, so weights in aten's layout run dense in fp32 without being timed, unless
``quant_packed_max_rows`` forces the packed kernels; the blocks kernel (blocks.py) is timed.

The timing costs a start (17 of 27 s of a worker's on the embedded GGUF, 2 cores), and
its answer depends only on the machine, so it is kept in $TANDEM_CACHE/kernel_paths.json,
keyed by the shape, the layer count, the CPU (model name, SIMD flags, threads), torch's
version and the kernels' source: a restart on the same machine reads it. A timing pass
that did not have its cores to itself (its threads got under ``UNDISTURBED`` of their CPU
time, engine/timing.py CpuShare: another process was busy beside it) is timed once more,
and one disturbed twice is used for this start only, never kept: one run beside a test
suite once left a choice in the file that ran a Q4_1 layer dense at one row, 2x slower,
on every later start. Delete the file to time again, or fix the choice with
--quant-packed-max-rows.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from core.cache_home import cache_home
from engine.native import simd_flags
from engine.quant.linear import QuantLinear
from engine.timing import CpuShare, best_pair

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"

ROWS = (1, 2, 4, 8, 16, 32, 64)
CLEAR_LOSS = 1.5
"""A packed kernel this many times slower than the dense GEMM has lost for good."""
UNDISTURBED = 0.85
"""A CPU timing pass whose threads got at least this share of their CPU time had the
cores to itself (CpuShare: ~1 alone, 0.75 beside one other busy process)."""
TRIES = 2
"""Timing passes per shape before a disturbed one is used (for this start only)."""


def _best_us(packed, dense) -> tuple[float, float]:
    """Best us of each, timed in turn; a packed loss is timed again (best_pair)."""
    tp, td = best_pair(packed, dense, reps=3, warmup=1, retry_if=lambda p, d: p >= d)
    return tp * 1e6, td * 1e6


@torch.inference_mode()
def measure(layers: list[QuantLinear]) -> tuple[int, list[tuple[int, float, float]]]:
    """layers: all of one shape -> (packed_max_rows, [(rows, packed us, dense us)]), the
    times per layer of a pass over all of them."""
    w = layers[0].weight
    table: list[tuple[int, float, float]] = []
    best_rows, losses = 0, 0
    for m in ROWS:
        x = torch.randn(m, layers[0].in_features, dtype=w.dtype, device=w.device)
        tp, td = _best_us(lambda: [layer.packed_forward(x) for layer in layers],
                          lambda: [layer.dense_forward(x) for layer in layers])
        tp, td = tp / len(layers), td / len(layers)
        table.append((m, tp, td))
        if tp < td and losses == 0:
            best_rows = m
        else:
            losses += 1
            # a clear loss ends it at once: the packed kernels' cost grows faster with the
            # rows than the dense GEMM's (the int8 LM head in bf16: 1.3x slower at 8 rows,
            # 2.5x at 16)
            if losses == 2 or tp >= CLEAR_LOSS * td:
                break
    return best_rows, table


def _unvectorised(dtype: torch.dtype, device: str, layout: str) -> bool:
    """aten's int kernels in fp32 on a CPU: 8-10x slower than the dense GEMM at any size."""
    return dtype == torch.float32 and device == "cpu" and layout == "aten"


def choose_paths(layers: list[QuantLinear], forced: int | None,
                 cache: Path | None = None) -> dict[tuple, tuple]:
    """Set every layer's packed_max_rows; returns {shape key: (rows, table)} measured, or
    read from cache (a JSON file, see the module's docstring) where it holds the shape."""
    if forced is not None:
        for layer in layers:
            layer.packed_max_rows = forced
        return {}
    groups: dict[tuple, list[QuantLinear]] = {}
    for layer in layers:
        key = (layer.kind, layer.out_features, layer.in_features, layer.group_size,
               layer.weight.dtype, layer.weight.device.type, layer.layout)
        groups.setdefault(key, []).append(layer)
    known, fresh, measured, hits = _read(cache), {}, {}, 0
    sources = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.cpp")))
    kernels = hashlib.sha256(sources).hexdigest()[:12]
    for key, group in groups.items():
        name = _entry(key, group, kernels)
        if _unvectorised(*key[4:]):
            measured[key] = (0, [])
        elif name in known:
            measured[key] = (known[name][0], [tuple(row) for row in known[name][1]])
            hits += 1
        else:
            measured[key], undisturbed = _measure_alone(group, cache)
            if undisturbed:
                fresh[name] = measured[key]
    if cache is not None and fresh:  # merged with what workers beside this one wrote
        _write(cache, {**_read(cache), **fresh})
    if hits:
        log.info("kernel choice per row count for %d weight shape(s) read from %s (delete "
                 "it to time again)", hits, cache)
    for key, group in groups.items():
        for layer in group:
            layer.packed_max_rows = measured[key][0]
    return measured


def _measure_alone(group: list[QuantLinear], cache: Path | None
                   ) -> tuple[tuple[int, list[tuple[int, float, float]]], bool]:
    """``measure`` until a pass had its cores to itself (at most TRIES): (its result,
    whether it did). A GPU's timing is not judged by the host's CPU time."""
    threads = torch.get_num_threads()
    for _ in range(TRIES):
        with CpuShare(threads) as got:
            result = measure(group)
        if got.share >= UNDISTURBED or group[0].weight.device.type != "cpu":
            return result, True
    w = group[0]
    log.warning("kernel timing for [%d,%d] x %d layers was disturbed twice (its %d threads got "
                "%.0f%% of their CPU time: another process was busy): packed up to %d rows "
                "for this start only, not kept in %s (--quant-packed-max-rows fixes it)",
                w.out_features, w.in_features, len(group), threads, 100 * got.share,
                result[0], cache)
    return result, False


def default_cache() -> Path:
    return cache_home() / "kernel_paths.json"


def _entry(key: tuple, group: list[QuantLinear], kernels: str) -> str:
    """What the timing depends on: the shape and how many layers a pass runs, the
    activations' form, the dense GEMM timed against (prepacked or not), the CPU and its
    threads, torch, and the kernels' source (its hash, ``kernels``, read once per choice)."""
    where = (torch.cuda.get_device_name() if key[5] == "cuda"
             else f"{_cpu_model()} {' '.join(simd_flags())}")
    dense = "onednn-prepacked" if group[0].onednn_weight is not None else "F.linear"
    return json.dumps([*map(str, key), group[0].activations, dense, len(group), where,
                       torch.get_num_threads(), torch.__version__, kernels])


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    return next((ln.partition(":")[2].strip() for ln in text.splitlines()
                 if ln.startswith("model name")), "unknown CPU")


def _read(cache: Path | None) -> dict:
    try:
        return json.loads(cache.read_text()) if cache is not None else {}
    except (OSError, ValueError):
        return {}


def _write(cache: Path, known: dict) -> None:
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache)  # atomic: workers starting side by side each write a whole file
    except OSError as e:  # a read-only cache costs the timing at the next start, no more
        log.warning("cannot keep the kernel timing in %s: %s", cache, e)
