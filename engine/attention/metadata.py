"""Per-step attention metadata, built once by the runner and passed down explicitly.

The batch is flattened: all new tokens of all sequences concatenated, the
sequences that prefill (a chunk of one or more prompt tokens over a possibly
cached prefix) first, then the decoding ones (exactly one new token each).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    query_lens: list[int]
    """New tokens per sequence this step, prefills first."""
    seq_lens: list[int]
    """Context length per sequence after this step (cached + new tokens)."""
    num_prefills: int
    """Leading sequences that run through the prefill path."""
    block_tables: list[list[int]]
    """KV block ids per sequence, covering at least seq_lens[i] tokens."""
    block_size: int
    slot_blocks: torch.Tensor
    """[T] long: the block each new token's K/V is written to."""
    slot_offsets: torch.Tensor
    """[T] long: the row inside that block."""
    kv_quant: str | None = None
    """None: the KV cache holds K/V in the compute dtype; int8 | fp8_e4m3: quantized rows
    with their scales (engine/kv_cache/quant.py), quantized on write, dequantized on read."""
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    """Sequence index -> its attention-score accumulator [L, Hkv, slots] fp32, for the
    sequences whose KV policy evicts by attention (h2o): backends add into it
    (engine/attention/base.py add_scores); empty for every other step."""
    score_decay: dict[int, float] = field(default_factory=dict)
    """Sequence index -> the factor its scores fade by per token (h2o's halflife): the
    step's queries add their probabilities weighted so that the sum equals adding them
    one token at a time (add_scores); absent: weight 1."""
    scratch: dict[str, Any] = field(default_factory=dict)
    """Derived tensors a backend builds once per step and reuses in every layer."""

    @property
    def num_decodes(self) -> int:
        return len(self.query_lens) - self.num_prefills

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.query_lens[: self.num_prefills])

    def cached(self, key: str, build) -> Any:
        """Build a per-step derived value once (first layer), reuse it in the others."""
        if key not in self.scratch:
            self.scratch[key] = build()
        return self.scratch[key]


def build_metadata(query_lens: list[int], seq_lens: list[int], num_prefills: int,
                   block_tables: list[list[int]], block_size: int,
                   device: torch.device | str = "cpu", kv_quant: str | None = None
                   ) -> AttentionMetadata:
    """Compute the write slots of every new token from its position and block table."""
    blocks: list[int] = []
    offsets: list[int] = []
    for qlen, slen, table in zip(query_lens, seq_lens, block_tables):
        for pos in range(slen - qlen, slen):
            blocks.append(table[pos // block_size])
            offsets.append(pos % block_size)
    return AttentionMetadata(
        query_lens=query_lens, seq_lens=seq_lens, num_prefills=num_prefills,
        block_tables=block_tables, block_size=block_size,
        slot_blocks=torch.tensor(blocks, dtype=torch.long, device=device),
        slot_offsets=torch.tensor(offsets, dtype=torch.long, device=device),
        kv_quant=kv_quant,
    )


@dataclass(frozen=True)
class DecodeSlots:
    """A decode-only step's attention inputs as tensors whose shapes depend on the bucket
    alone, for a step compiled as one graph (engine/compile/decode.py): the graph cannot
    branch on a step's Python lists, and a shape that changed with the longest context
    would compile it again. Rows past the step's own are the bucket's padding: block -1
    (nothing written) and length 0 (nothing read, zeros out)."""

    blocks: torch.Tensor
    """[R] long: the block each row's new K/V goes to; -1 for padding rows."""
    offsets: torch.Tensor
    """[R] long: the row inside that block."""
    tables: torch.Tensor
    """[R, W] long: block tables padded with block 0 to the fixed width W (entries past a
    row's length are never read)."""
    lens: torch.Tensor
    """[R] long: context length after this step; 0 for padding rows."""


def decode_slots(meta: AttentionMetadata, rows: int, width: int,
                 device: torch.device | str = "cpu") -> DecodeSlots | None:
    """``meta``'s decode-only step padded to ``rows`` rows and tables of ``width`` blocks, or
    None where a table is wider (that step takes the per-layer path)."""
    tables = meta.block_tables
    if any(len(t) > width for t in tables):
        return None
    pad = rows - len(tables)
    return DecodeSlots(
        blocks=torch.cat([meta.slot_blocks, meta.slot_blocks.new_full((pad,), -1)]),
        offsets=torch.cat([meta.slot_offsets, meta.slot_offsets.new_zeros(pad)]),
        tables=torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad,
                            dtype=torch.long, device=device),
        lens=torch.tensor(meta.seq_lens + [0] * pad, dtype=torch.long, device=device))
