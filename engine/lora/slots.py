"""The adapters resident in one model (``--max-loras`` slots) and the per-step map of
rows to slots.

A step's adapters are made resident before its forward pass: one already in a slot
stays there; another takes a free slot, else the least recently used slot whose adapter
is not in this step (copying an adapter in is one small copy per linear, done on the
engine thread between steps). The scheduler never runs more distinct adapters at once
than there are slots (Scheduler.lora_fits), so a step always finds room.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora.adapter import LoRAAdapter
from engine.lora.layers import LoRALinear, LoRAState, Target


class LoRASlots:
    def __init__(self, model: nn.Module, targets: dict[str, Target], max_loras: int,
                 max_rank: int) -> None:
        """Wrap every targetable linear of ``model`` (in its final dtype and device)."""
        self.state = LoRAState()
        self.max_loras = max_loras
        self.layers: dict[str, LoRALinear] = {}
        for path, target in targets.items():
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            layer = LoRALinear(getattr(parent, attr), target.shards, self.state, max_loras,
                               max_rank)
            setattr(parent, attr, layer)
            self.layers[path] = layer
        self.resident: OrderedDict[bytes, int] = OrderedDict()
        """Adapter identity -> its slot, least recently used first."""
        self.on_load: Callable[[int, LoRAAdapter], None] | None = None
        """Called before an adapter is copied into a slot (a tensor-parallel group's rank
        0 sends it to the other ranks, engine/parallel/runner.py)."""

    def assign(self, rows: Sequence[LoRAAdapter | None]) -> list[int]:
        """Each row's slot + 1 (0: the base model), the adapters made resident first."""
        slots = self._make_resident({a.identity: a for a in rows if a is not None})
        return [slots[a.identity] + 1 if a is not None else 0 for a in rows]

    def onehot(self, idx: Sequence[int], total: int) -> torch.Tensor:
        """[total, max_loras] for a pass whose rows use slots ``idx`` (``assign``; rows
        past len(idx) are padding of a compiled bucket: base)."""
        some = next(iter(self.layers.values())).lora_a
        onehot = F.one_hot(torch.tensor([*idx, *[0] * (total - len(idx))]),
                           self.max_loras + 1)[:, 1:]  # column 0: base rows, dropped
        return onehot.to(device=some.device, dtype=some.dtype)

    def _make_resident(self, wanted: dict[bytes, LoRAAdapter]) -> dict[bytes, int]:
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step, {self.max_loras} slots "
                               f"(--max-loras): the scheduler admits no more than fit")
        for identity in wanted:
            if identity in self.resident:
                self.resident.move_to_end(identity)
        for identity, adapter in wanted.items():
            if identity not in self.resident:
                self._load(adapter, self._free_slot(wanted))
        return {i: self.resident[i] for i in wanted}

    def _free_slot(self, wanted: dict[bytes, LoRAAdapter]) -> int:
        used = set(self.resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        victim = next(i for i in self.resident if i not in wanted)  # least recently used
        return self.resident.pop(victim)

    def _load(self, adapter: LoRAAdapter, slot: int) -> None:
        if self.on_load is not None:
            self.on_load(slot, adapter)
        self.load(slot, adapter.placed)
        self.resident[adapter.identity] = slot

    @torch.no_grad()
    def load(self, slot: int, placed: dict[str, list]) -> None:
        """Fill ``slot`` with an adapter's placed parts (LoRAAdapter.placed: linear path
        -> [(shard index, A, B)], whole; each layer cuts its rank's part)."""
        for path, layer in self.layers.items():
            layer.set_slot(slot, placed.get(path, []))


def lora_rows(slots: LoRASlots | None, idx: Sequence[int], total: int,
              compiled: bool = False) -> AbstractContextManager:
    """The context one forward pass of ``total`` rows runs in: row t under slot idx[t] - 1
    (0: the base; rows past len(idx), padding, too). Without LoRA, or without an adapter
    row, nothing: the base graph. A compiled pass reads every slot (one graph per
    bucket, not one per number of slots in use)."""
    if slots is None or not any(idx):
        return nullcontext()
    used = slots.max_loras if compiled else max(idx)
    return slots.state.rows(slots.onehot(idx, total), used)


def warm_rows(slots: LoRASlots | None, total: int) -> AbstractContextManager:
    """A compiled bucket's LoRA variant at start-up (every slot read, no row's adapter)."""
    if slots is None:
        return nullcontext()
    some = next(iter(slots.layers.values())).lora_a
    return slots.state.rows(some.new_zeros(total, slots.max_loras), slots.max_loras)
