"""Dense GEMMs on weights prepacked for oneDNN (CPU, bf16 and fp32).

``F.linear`` hands oneDNN (or MKL) a plain ``[N, K]`` weight, which is reordered into
the kernel's blocked layout on every call. A linear that keeps the reordered copy
(``prepack_linears``, once at load) skips that: for the 120 GEMMs of one decode step of
the embedded model (30 layers, cold weights),
``bench/dense_gemm.py`` on an AMD EPYC with AVX-512 BF16, 2 threads (docs/performance.md,
"Prepacked dense GEMMs"):

    rows   bf16 plain -> prepacked   fp32 plain -> prepacked   fp32 under an avx2 ceiling
    8        19.8 ->  12.6 ms          40.4 -> 21.3 ms           40.0 -> 24.9 ms
    32       36.0 ->  24.9 ms          72.8 -> 48.5 ms           72.1 -> 48.2 ms
    512     317.7 -> 297.3 ms         674.1 -> 578.4 ms         583.9 -> 519.3 ms

The copy is exact: the same weights in another layout; in bf16 the products equal
``F.linear``'s bit for bit (oneDNN computes both), in fp32 they differ by fp32 rounding
(MKL's sgemm sums in another order; tests/engine/test_dense_prepack.py). It costs the
dense weights' bytes once more (the plain weight stays: a tied embedding, LoRA and the
packed kernels' timing read it); ``--no-prepack-weights`` turns it off.

Under torch.compile the call goes through ``tandem_dense::linear``, a custom op: inductor
lowers ``mkldnn._linear_pointwise`` only for a frozen constant weight, and the compiled
layer segment takes each layer's weights as graph inputs (engine/compile/decode.py).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from engine.native import cpu_flags

BF16_FLAGS = {"avx512bw", "avx512vl", "avx512dq"}
"""What oneDNN's bf16 weight reorder needs (or avx_ne_convert), as engine/native.py
cpu_flags sees the CPU: under an avx2 ceiling oneDNN refuses it."""
ROWS_HINT = 32
"""The row count oneDNN picks the packed layout for; any row count runs on it (a decode
batch of 32 is where the reorder cost mattered most)."""


@torch.library.custom_op("tandem_dense::linear", mutates_args=())
def _linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@_linear_op.register_fake
def _(x, packed, bias):
    return x.new_empty((x.shape[0], packed.shape[0]))


def unavailable(weight: torch.Tensor) -> str | None:
    """Why this weight cannot be prepacked (None: it can)."""
    if weight.device.type != "cpu":
        return f"{weight.device.type} weights multiply with the device's own GEMMs"
    if weight.dtype not in (torch.bfloat16, torch.float32):
        return f"no prepacked oneDNN GEMM for {weight.dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if weight.dtype == torch.bfloat16 and not (BF16_FLAGS <= cpu_flags()
                                               or "avx_ne_convert" in cpu_flags()):
        return (f"oneDNN's prepacked bf16 GEMM needs {', '.join(sorted(BF16_FLAGS))} or "
                "avx_ne_convert, which this CPU (or the capability ceiling) lacks")
    return None


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> the same weights in oneDNN's blocked layout (an MKLDNN tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) with W prepacked (``prepack``)."""
    if torch.compiler.is_compiling():
        return _linear_op(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def forward(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
            bias: torch.Tensor | None) -> torch.Tensor:
    """A dense linear's forward: on its prepacked weight when it has one, else
    ``F.linear`` on the plain weight."""
    if packed is not None:
        return linear(x, packed, bias)
    return F.linear(x, weight, bias)


def prepack_linears(model: nn.Module) -> tuple[int, int, str | None]:
    """Give every linear with a dense forward (engine/layers/linear.py Linear, and the
    dense side of engine/quant/linear.py QuantLinear) its prepacked weight.
    -> (linears prepacked, bytes the copies take, why none was when that is so)."""
    count, nbytes, reason = 0, 0, None
    for mod in model.modules():
        if not hasattr(mod, "onednn_weight"):
            continue
        reason = unavailable(mod.weight)
        if reason is not None:
            return 0, 0, reason
        mod.onednn_weight = prepack(mod.weight)
        count += 1
        nbytes += mod.weight.numel() * mod.weight.element_size()
    return count, nbytes, reason
