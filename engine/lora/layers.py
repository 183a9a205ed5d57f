"""Batched LoRA on top of any linear (dense ``Linear`` or packed ``QuantLinear``): one
step's rows each use their own adapter, or none, in two matmuls per linear.

Each wrapped linear holds every resident adapter (a *slot*, ``--max-loras`` = S of them,
rank up to ``--max-lora-rank`` = R) stacked: ``lora_a`` [K, S x shards x R] and, per
shard of its output (q, k, v of a fused q/k/v), ``lora_b{i}`` [S x R, shard rows]. A
pass computes ``h = x @ lora_a`` for all slots at once, zeroes in each row the slots
that are not its own (``LoRAState.onehot`` [T, S], one 1 per adapter row, none for a
base row) and adds ``h_i @ lora_b{i}`` per shard; both matmuls run over the slots up to
the highest in use (``LoRAState.used``; slots are handed out lowest free first; a
compiled step reads all). No loop over rows nor over adapters (a loop over a linear's
shards, at most 3, avoids multiplying the zero blocks a single fused B would hold); a fused linear's projections each take their own
adapter's A columns and B rows (an adapter of Phi-3's fused ``qkv_proj`` is one shard).
A pass with no adapter row skips all of it (LoRAState.onehot None); the compiled decode
step traces both variants at start-up (docs/performance.md,
"Multi-LoRA").

On a rank of a tensor-parallel group the base linear is split (``base.shard``,
engine/parallel/shard.py) and the adapter is split with it: a column split keeps, of
each shard's B, the output rows the rank's weight keeps (its A whole); a row split
keeps the input columns of A (its B whole), so ``x @ A_part @ B`` is a partial sum
like the base's, reduced by the same all-reduce (the split's forward hook moves onto
the wrapper, which adds the two before it runs).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch
from torch import nn

from engine.layers.linear import Linear, move_forward_hooks
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
        self.used = 0
        """Slots [0, used) are the only ones this pass reads (the rest hold no row's
        adapter): the expand matmuls stop there."""

    @contextmanager
    def rows(self, onehot: torch.Tensor, used: int) -> Iterator[None]:
        if self.onehot is not None:
            raise RuntimeError("LoRAState.rows: a forward pass is already under way")
        self.onehot, self.used = onehot, used
        try:
            yield
        finally:
            self.onehot, self.used = None, 0


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, shards: Shards, state: LoRAState, slots: int,
                 max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.shards, self.state = shards, state
        self.slots, self.max_rank = slots, max_rank
        split = getattr(base, "shard", None)
        self.cols = split.cols if split is not None else None
        """The input columns (start, length) of A this rank keeps (a row split); None: all."""
        self.keep = [_kept_rows(rows, split.rows if split is not None else ())
                     for _, rows in shards]
        """Per shard, the (start, length) pieces of its B rows this rank keeps."""
        w = base.weight
        # columns slot-major: [slot s][shard i][rank r], so the slots in use are a prefix
        self.register_buffer("lora_a", w.new_zeros(base.in_features,
                                                   len(shards) * slots * max_rank),
                             persistent=False)
        for i, pieces in enumerate(self.keep):
            self.register_buffer(f"lora_b{i}", w.new_zeros(slots * max_rank,
                                                           sum(n for _, n in pieces)),
                                 persistent=False)
        move_forward_hooks(base, self)  # a row split's all-reduce sums base + adapter

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
        t, n, u, r = x.shape[0], len(self.shards), self.state.used, self.max_rank
        h = (x @ self.lora_a[:, :u * n * r]).view(t, u, n, r)  # [T, used slots, shards, R]
        h = h * onehot[:, :u, None, None]  # each row keeps its own slot's columns only
        outs = [h[:, :, i].reshape(t, u * r) @ getattr(self, f"lora_b{i}")[:u * r]
                for i in range(n)]  # per shard [T, rows]: no block of zeros multiplied
        return y + (outs[0] if n == 1 else torch.cat(outs, dim=1))

    @torch.no_grad()
    def set_slot(self, slot: int, parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Fill one slot with an adapter's (shard index, A [r, K], B [rows, r]), whole
        (this rank's part is cut here); zeros where the adapter has no shard (so a fresh
        slot carries nothing of the last)."""
        n, r = len(self.shards), self.max_rank
        self.lora_a[:, slot * n * r:(slot + 1) * n * r] = 0
        for i in range(n):
            getattr(self, f"lora_b{i}")[slot * r:(slot + 1) * r] = 0
        for i, a, b in parts:
            if self.cols is not None:
                a = a.narrow(1, *self.cols)
            b = torch.cat([b.narrow(0, start, length) for start, length in self.keep[i]])
            at, k = (slot * n + i) * r, a.shape[0]
            self.lora_a[:, at:at + k] = a.t().to(self.lora_a)
            getattr(self, f"lora_b{i}")[slot * r:slot * r + k] = b.t().to(self.lora_a)


def _kept_rows(rows: slice, pieces: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """The (start, length) pieces, within one shard's rows of the unsplit output, that a
    column split keeping ``pieces`` (unsplit row ranges, in order) keeps; all without."""
    if not pieces:
        return [(0, rows.stop - rows.start)]
    out = []
    for start, n in pieces:
        lo, hi = max(start, rows.start), min(start + n, rows.stop)
        if lo < hi:
            out.append((lo - rows.start, hi - lo))
    return out


def target_map(model: nn.Module) -> dict[str, Target]:
    """Every linear an adapter may target -> its shards (read before quantization swaps
    the Linears; the LM head is left out: logits are computed for the sampled rows only,
    and a tied head is the embedding). Read on the unsplit model: an adapter is checked
    against, and sent to a group's ranks as, the whole model's shapes."""
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

