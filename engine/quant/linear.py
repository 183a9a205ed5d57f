"""A linear layer that keeps both its packed weight and its dense weight, and picks
the faster kernel by the number of rows in the call.

At a handful of rows a weight-only int kernel reads 2-4x fewer bytes than a bf16
GEMM and wins; with more rows the bf16 GEMM (AMX tiles) catches up: from about 8
rows with aten's kernels, which unpack the weight again for every few rows, and
from 32-64 with our int4 kernel, which unpacks it once per call (packed.py; see
``engine/quant/select.py`` and ``bench/quant_kernels.py``). So the layer holds
both: the packed weight costs 0.5 (int4/g32: 0.625) or 1 byte per weight on top
of the dense copy. The choice depends only on the row count, which is static in
a compiled step, so it is resolved at trace time.

A bias (Qwen2's q/k/v, Llama's ``attention_bias``/``mlp_bias``) is kept as the
nn.Linear held it and added on either path, after whichever kernel ran: every
layout's kernel (block_mm, int4_mm, aten's int8/int4) computes x @ W^T only, and
adding [N] to [M, N] here costs nothing next to it.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.layers import dense
from engine.quant.packed import PackedWeight


class QuantLinear(nn.Module):
    def __init__(self, dense: nn.Linear, packed: PackedWeight, label: str) -> None:
        super().__init__()
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.weight = dense.weight  # [N, K]; shared with a tied embedding
        self.bias = dense.bias  # [N] or None; the model's .to(dtype) casts it with the weight
        self.shard = getattr(dense, "shard", None)  # a tensor-parallel rank's part (LoRA cuts by it)
        self.kind, self.group_size, self.label = packed.kind, packed.group_size, label
        self.layout, self.activations = packed.layout, packed.activations
        self.amx_min_rows, self.dot_min_rows = packed.amx_min_rows, packed.dot_min_rows
        self.register_buffer("qdata", packed.data, persistent=False)
        self.register_buffer("qscales", packed.scales, persistent=False)
        self.register_buffer("onednn_weight", None, persistent=False)
        """The dense weight prepacked for oneDNN (engine/layers/dense.py); None: F.linear."""
        self.packed_max_rows = 0
        """Calls with at most this many rows use the packed kernel (set by select.py)."""

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.kind, self.qdata, self.qscales, self.out_features,
                            self.in_features, self.group_size, self.layout, self.activations,
                            self.amx_min_rows, self.dot_min_rows)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        y = self.packed.matmul(x)
        return y if self.bias is None else y + self.bias

    def dense_forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        return dense.forward(x, self.weight, self.onednn_weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if x.shape[0] <= self.packed_max_rows:
            return self.packed_forward(x)
        return self.dense_forward(x)

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, "
                f"{self.label}, "
                f"packed up to {self.packed_max_rows} rows")
