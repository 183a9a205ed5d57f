"""One forward pass's inputs (the runner's plan of a step) and the commands rank 0 of a
tensor-parallel group sends the other ranks, as flat int64 tensors: every rank runs the
same forward on its shard, so each needs exactly what rank 0's runner computes from the
scheduler's batch, and nothing of the requests themselves. Plain integers, never
pickles, cross between the processes."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Op(enum.IntEnum):
    """What a command asks the other ranks to do."""

    BUILD = 1
    """Build the runner: the payload is the EngineConfig as JSON bytes."""
    STEP = 2
    """Run one forward: the payload is a StepInputs."""
    COPY = 3
    """Swap blocks between the KV pool and the host pool: the payload is a Copies."""
    CLOSE = 4
    """Drop the runner (its weights and KV pool); the rank waits for the next BUILD."""
    EXIT = 5
    """Leave the group and end the process."""
    GATHER_KV = 6
    """Send rank 0 this rank's KV heads of some blocks: the payload is the block ids
    (engine/parallel/kv_heads.py)."""
    SCATTER_KV = 7
    """Take this rank's KV heads of some blocks from rank 0: the payload is the block ids."""
    SHIFT = 8
    """Re-rotate the keys of some blocks (a bounded KV policy dropped blocks before them):
    the payload is the shift in positions, then the block ids."""
    LORA = 9
    """Fill a LoRA slot with an adapter: the payload is an AdapterSlot."""
    EVICT = 10
    """Evict h2o's victims from a full cache (engine/kv_cache/h2o.py compact): the payload
    is the slots, the table's length, the table, then the victims [L, Hkv] (every head's:
    each rank takes its own)."""
    GATHER_HOST = 11
    """As GATHER_KV, of host slots (the swap pool and host tier's tensor): the payload is
    the slots (a block spilled to the disk tier, whose files hold every head)."""
    SCATTER_HOST = 12
    """As SCATTER_KV, into host slots: the payload is the slots (a disk read landing)."""


@dataclass
class StepInputs:
    """What one forward pass runs: the tokens, where they sit, the attention layout
    (query and sequence lengths, block tables) and which rows' logits are wanted."""

    ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    num_prefills: int
    tables: list[list[int]]
    logit_rows: list[int]
    """Rows of the hidden states [T, H] the LM head runs on; empty: no logits."""
    decode_only: bool
    """Every query is one token (a compiled decode bucket may run it)."""
    prompt_chunks: list[tuple[int, int]] = field(default_factory=list)
    """Row ranges [start, stop) the LM head runs on, in order, for prompt logprobs (rank 0
    turns them into logprobs; in a group every rank must run the same LM-head calls)."""
    lora_slots: list[int] = field(default_factory=list)
    """Each row's LoRA slot + 1 (0: the base model); empty: every row the base."""
    scored: list[tuple[int, int, int]] = field(default_factory=list)
    """(sequence index, slots, halflife) of each sequence whose attention scores h2o
    keeps: every rank adds its heads' share into [L, its KV heads, slots] (its queries
    weighted by the halflife's fading, 0: none) and sends it to rank 0."""
    num_layers: int = 0
    """Run only the first this many layers, then the final norm and LM head (a self:N
    draft pass, engine/spec/draft.py); 0: every layer."""

    def encode(self) -> torch.Tensor:
        """Lengths first, then each list: a flat int64 tensor ``decode`` reads back."""
        head = [self.num_prefills, int(self.decode_only), len(self.ids), len(self.query_lens),
                len(self.logit_rows), len(self.prompt_chunks), len(self.lora_slots),
                len(self.scored), self.num_layers]
        body = (self.ids + self.positions + self.query_lens + self.seq_lens + self.logit_rows
                + [b for chunk in self.prompt_chunks for b in chunk] + self.lora_slots
                + [x for triple in self.scored for x in triple]
                + [len(t) for t in self.tables] + [b for t in self.tables for b in t])
        return torch.tensor(head + body, dtype=torch.int64)

    @classmethod
    def decode(cls, flat: torch.Tensor) -> StepInputs:
        values = flat.tolist()
        num_prefills, decode_only, n, q, r, c, a, h, layers = values[:9]
        at = 9

        def take(k: int) -> list[int]:
            nonlocal at
            at += k
            return values[at - k:at]

        ids, positions, qlens, slens, rows = take(n), take(n), take(q), take(q), take(r)
        bounds, slots, scored = take(2 * c), take(a), take(3 * h)
        tables = [take(k) for k in take(q)]
        return cls(ids, positions, qlens, slens, num_prefills, tables, rows, bool(decode_only),
                   list(zip(bounds[::2], bounds[1::2])), slots,
                   list(zip(scored[::3], scored[1::3], scored[2::3])), layers)


@dataclass
class AdapterSlot:
    """An adapter rank 0 makes resident in a slot, as every rank fills it: per part, the
    index of the linear (in LoRASlots.layers' order, the same on every rank), the shard
    of that linear, A [r, K] and B [N, r], whole (each rank cuts its own part). The
    weights travel as their fp32 bits in the int64 payload (still no pickle)."""

    slot: int
    parts: list[tuple[int, int, torch.Tensor, torch.Tensor]]

    def encode(self) -> torch.Tensor:
        head = [self.slot, len(self.parts)]
        for layer, shard, a, b in self.parts:
            head += [layer, shard, a.shape[0], a.shape[1], b.shape[0]]
        weights = [t.float().reshape(-1) for _, _, a, b in self.parts for t in (a, b)]
        flat = torch.cat([*weights, torch.zeros(sum(w.numel() for w in weights) % 2)])
        return torch.cat([torch.tensor(head, dtype=torch.int64), flat.view(torch.int64)])

    @classmethod
    def decode(cls, flat: torch.Tensor) -> AdapterSlot:
        slot, n = flat[:2].tolist()
        shapes = flat[2:2 + 5 * n].view(n, 5).tolist()
        weights, at, parts = flat[2 + 5 * n:].view(torch.float32), 0, []
        for layer, shard, r, k, rows in shapes:
            a = weights[at:at + r * k].view(r, k)
            b = weights[at + r * k:at + r * k + rows * r].view(rows, r)
            at += r * k + rows * r
            parts.append((layer, shard, a, b))
        return cls(slot, parts)


@dataclass
class Copies:
    """A step's block copies as ModelRunner.copy_blocks takes them: swaps, each side one
    list of (device block, host slot) pairs (copy_blocks treats its lists of pairs so
    anyway), and the copy-on-write pairs (source block, copy) of forked choices."""

    out_device: list[int]
    out_host: list[int]
    in_host: list[int]
    in_device: list[int]
    cow: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, swap_out: list[tuple[list[int], list[int]]],
           swap_in: list[tuple[list[int], list[int]]],
           copies: list[tuple[int, int]] = ()) -> Copies:
        return cls([d for dev, _ in swap_out for d in dev], [h for _, host in swap_out for h in host],
                   [h for host, _ in swap_in for h in host], [d for _, dev in swap_in for d in dev],
                   list(copies))

    def lists(self) -> tuple[list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]],
                             list[tuple[int, int]]]:
        """(swap_out, swap_in, copies) in copy_blocks' form."""
        return ([(self.out_device, self.out_host)], [(self.in_host, self.in_device)],
                list(self.cow))

    def encode(self) -> torch.Tensor:
        return torch.tensor([len(self.out_device), len(self.in_host), len(self.cow),
                             *self.out_device, *self.out_host, *self.in_host, *self.in_device,
                             *(b for pair in self.cow for b in pair)], dtype=torch.int64)

    @classmethod
    def decode(cls, flat: torch.Tensor) -> Copies:
        values = flat.tolist()
        o, i, c = values[:3]
        rest = values[3:]
        pairs = rest[2 * o + 2 * i:]
        return cls(rest[:o], rest[o:2 * o], rest[2 * o:2 * o + i], rest[2 * o + i:2 * o + 2 * i],
                   [(pairs[2 * k], pairs[2 * k + 1]) for k in range(c)])
