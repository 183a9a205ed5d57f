"""Batched LoRA on top of any linear (dense ``Linear`` or packed ``QuantLinear``): one
step's rows each use their own adapter, or none, in two matmuls per linear.

Each wrapped linear holds every resident adapter (a *slot*, ``--max-loras`` of them)
stacked: ``lora_a`` [K, S * Rc] and ``lora_b`` [S * Rc, N], where Rc is the rank a slot
may hold for this linear (the linear's shards x ``--max-lora-rank``). A step computes
``h = x @ lora_a`` for all slots at once, zeroes in each row the slots that are not its
own (``LoRAState.onehot`` [T, S], one 1 per adapter row, none for a base row) and adds
``h @ lora_b``. There is no loop over rows nor over adapters, and the shapes depend only
on the configuration, so the compiled decode step traces it once per bucket; the cost is
that of ``--max-loras`` x rank columns whatever the number of adapters in the batch
(docs/performance.md, "Multi-LoRA").

A fused linear (q/k/v, gate/up) takes each projection's adapter into its own rank
columns and output rows: shard i's A fills columns [i Rmax, i Rmax + r) of the slot,
its B the block of those columns and the shard's output rows, zeros elsewhere, so
``h @ lora_b`` is the adapters' outputs laid side by side as the fused output is.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.lora.adapter import AdapterError, LoRAAdapter

Shards = tuple[tuple[str, slice], ...]
"""(checkpoint module name, the output rows it fills) of one linear, in order."""


class Target(NamedTuple):
    """What an adapter may attach to: one linear's input width and its shards."""

    in_features: int
    shards: Shards


class LoRAState:
    """Which slot each row of the current forward pass uses: shared by every LoRALinear of
    one model, set for one pass at a time by ``rows`` (None outside: base only)."""

    def __init__(self) -> None:
        self.onehot: torch.Tensor | None = None
        """[T, S] in the compute dtype: row t uses slot s where onehot[t, s] = 1."""

    @contextmanager
    def rows(self, onehot: torch.Tensor) -> Iterator[None]:
        if self.onehot is not None:
            raise RuntimeError("LoRAState.rows: a forward pass is already under way")
        self.onehot = onehot
        try:
            yield
        finally:
            self.onehot = None


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, shards: Shards, state: LoRAState, slots: int,
                 max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.shards, self.state = shards, state
        self.slots, self.max_rank, self.cap = slots, max_rank, max_rank * len(shards)
        w = base.weight
        self.register_buffer("lora_a", w.new_zeros(base.in_features, slots * self.cap),
                             persistent=False)
        self.register_buffer("lora_b", w.new_zeros(slots * self.cap, base.out_features),
                             persistent=False)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        y = self.base(x)
        onehot = self.state.onehot
        if onehot is None:
            return y
        t = x.shape[0]
        h = (x @ self.lora_a).view(t, self.slots, self.cap)  # [T, S, Rc]
        h = (h * onehot[:, :, None]).view(t, self.slots * self.cap)  # other slots' zeroed
        return y + h @ self.lora_b  # [T, N]

    @torch.no_grad()
    def set_slot(self, slot: int, parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Fill one slot with an adapter's (shard index, A [r, K], B [rows, r]); zeros
        where the adapter has no shard (so a fresh slot carries nothing of the last)."""
        cols = slice(slot * self.cap, (slot + 1) * self.cap)
        self.lora_a[:, cols] = 0
        self.lora_b[cols] = 0
        for i, a, b in parts:
            r, at = a.shape[0], slot * self.cap + i * self.max_rank
            self.lora_a[:, at:at + r] = a.t().to(self.lora_a)
            self.lora_b[at:at + r, self.shards[i][1]] = b.t().to(self.lora_b)

    def clear_slot(self, slot: int) -> None:
        self.set_slot(slot, [])


def target_map(model: nn.Module) -> dict[str, Target]:
    """Every linear an adapter may target -> its shards (read before quantization swaps
    the Linears; the LM head is left out: logits are computed for the sampled rows only,
    and a tied head is the embedding)."""
    out = {}
    for path, mod in model.named_modules():
        if isinstance(mod, Linear) and path != "lm_head":
            parent = path.rpartition(".")[0]
            out[path] = Target(mod.in_features, tuple(
                (f"{parent}.{name}".lstrip("."), rows) for name, rows in mod.shard_rows()))
    return out


def place(adapter: LoRAAdapter, targets: dict[str, Target],
          renames: tuple[tuple[str, str], ...], architecture: str) -> None:
    """Map the adapter's modules onto our linears (``adapter.placed``). AdapterError on a
    module or target the model lacks, or shapes of another base."""
    where = {name: (path, i, rows) for path, target in targets.items()
             for i, (name, rows) in enumerate(target.shards)}
    suffixes = {name.rpartition(".")[2] for name in where}
    wanted = adapter.target_modules
    if not isinstance(wanted, str):
        missing = sorted(set(wanted) - suffixes)
        if missing:
            raise AdapterError(f"adapter {adapter.name}: target_modules {missing} name no "
                               f"linear of this {architecture} model (its linears: "
                               f"{sorted(suffixes)}); was it made for another base model "
                               f"({adapter.base_model})?")
    placed: dict[str, list] = {}
    for module, (a, b) in adapter.weights.items():
        ours = module
        for theirs, mine in renames:
            ours = ours.replace(theirs, mine)
        if ours not in where:
            raise AdapterError(f"adapter {adapter.name}: {module} (target_modules) is not a "
                               f"linear of this {architecture} model")
        path, i, rows = where[ours]
        in_features = targets[path].in_features
        if a.shape[1] != in_features or b.shape[0] != rows.stop - rows.start:
            raise AdapterError(
                f"adapter {adapter.name}: {module} maps [{a.shape[1]}] -> [{b.shape[0]}], "
                f"this model's {module} [{in_features}] -> [{rows.stop - rows.start}]: the "
                f"adapter was made for another base model ({adapter.base_model})")
        placed.setdefault(path, []).append((i, a, b))
    adapter.placed = placed

