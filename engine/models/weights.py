"""Checkpoint tensors -> model parameters, by the names each layer declares.

A ``Linear`` (engine/layers/linear.py) says which checkpoint tensors stack into it; any
other parameter is filled by the tensor of its own name. So a family declares its
checkpoint layout once, where it builds its layers, and loading needs no table of its own.

A tensor-parallel rank holds a part of some parameters (engine/parallel/shard.py cuts
the meta skeleton before anything is allocated, and records each part as a ``Cut`` in
its module's ``cuts``): each checkpoint tensor is cut as it is copied, so a rank never
allocates more than its share plus the one checkpoint tensor being read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from engine.layers.linear import Linear

Place = tuple[str, object]
"""(parameter name, the index into it a tensor fills: None for all, a row slice, an
expert (int), or an (expert, row slice) pair)."""


@dataclass(frozen=True)
class Cut:
    """The part of an unsplit parameter (shape ``full``) that one tensor-parallel rank
    holds: along ``dim``, the (start, length) pieces, concatenated in order. zero: the
    rank holds zeros instead (a row-split bias beyond rank 0: added once, not per rank).
    absmax: filled, as the weight loads, with each unsplit row's max |w| (a row split's
    int8 scale is the whole row's, engine/quant/base.py Shard); None unless the weights
    will be packed as int8, so a rank reads no more than its columns."""

    full: tuple[int, ...]
    dim: int = 0
    pieces: tuple[tuple[int, int], ...] = ()
    zero: bool = False
    absmax: torch.Tensor | None = None

    def load(self, param: torch.Tensor, index: object, w: torch.Tensor) -> None:
        """Copy this rank's part of ``w`` (which fills ``unsplit[index]``) into param."""
        if self.zero:
            param.zero_()
            return
        if self.absmax is not None:  # a Linear weight [out, in]; index: its rows or all
            rows = w.to(param.dtype).abs().amax(dim=-1).float().to(self.absmax.device)
            self.absmax[slice(None) if index is None else index] = rows
        idx = _entries(index)
        idx += (slice(None),) * (self.dim + 1 - len(idx))
        at = idx[self.dim]
        if isinstance(at, int):  # one expert along the cut: held here or not at all
            local = self._local(at, at + 1)
            if local:
                param[idx[:self.dim] + (local[0][0],) + idx[self.dim + 1:]].copy_(w)
            return
        a, b, _ = at.indices(self.full[self.dim])
        w_dim = self.dim - sum(isinstance(i, int) for i in idx[:self.dim])
        for start, lo, hi in self._local(a, b):
            place = idx[:self.dim] + (slice(start, start + hi - lo),) + idx[self.dim + 1:]
            param[place].copy_(w.narrow(w_dim, lo - a, hi - lo))

    def _local(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """(local start, unsplit lo, unsplit hi) of each overlap of [a, b) with a piece."""
        out, offset = [], 0
        for s, n in self.pieces:
            lo, hi = max(a, s), min(b, s + n)
            if lo < hi:
                out.append((offset + lo - s, lo, hi))
            offset += n
        return out


def _entries(index: object) -> tuple:
    if index is None:
        return ()
    return index if isinstance(index, tuple) else (index,)


def cuts_of(model: nn.Module) -> dict[str, Cut]:
    """Parameter name -> its Cut, for every parameter a rank holds a part of."""
    return {f"{path}.{name}".lstrip("."): cut for path, mod in model.named_modules()
            for name, cut in getattr(mod, "cuts", {}).items()}


def checkpoint_map(model: nn.Module, skip: set[str] = frozenset()) -> dict[str, Place]:
    """Every checkpoint tensor the model needs -> where it goes (``skip``: names of
    parameters filled another way, e.g. a tied LM head)."""
    out: dict[str, Place] = {}
    for path, mod in model.named_modules():
        prefix = path + "." if path else ""
        if hasattr(mod, "checkpoint_places"):  # stacked weights (MoE experts) say their own
            out.update(mod.checkpoint_places(path))
            continue
        if isinstance(mod, Linear):
            parent = path.rpartition(".")[0]
            for pname in ("weight", "bias"):
                if getattr(mod, pname) is None:
                    continue
                for name, rows in mod.shard_rows():
                    out[f"{parent}.{name}.{pname}".lstrip(".")] = (prefix + pname, rows)
            continue
        for pname, _ in mod.named_parameters(recurse=False):
            out[prefix + pname] = (prefix + pname, None)
    for name in skip:
        out.pop(name, None)
    return out


def load_tensors(model: nn.Module, where: dict[str, Place],
                 tensors: Iterable[tuple[str, torch.Tensor]], ignored: tuple[str, ...],
                 architecture: str, renames: Sequence[tuple[str, str]] = ()) -> None:
    """Copy each tensor to its place; ValueError naming the tensor when it has none, has
    the wrong shape, or never came. renames: (checkpoint substring, ours) applied to
    each name first (a family whose checkpoints name a module otherwise)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    cuts = cuts_of(model)
    seen: set[str] = set()
    for name, w in tensors:
        if any(name == i or i in name for i in ignored):
            continue
        key = name  # errors name the checkpoint's tensor, not our name for it
        for theirs, ours in renames:
            key = key.replace(theirs, ours)
        if key not in where:
            raise ValueError(f"checkpoint tensor {name} has no place in the {architecture} "
                             f"model (does config.json describe this checkpoint?)")
        pname, index = where[key]
        cut = cuts.get(pname)
        whole = params[pname] if cut is None else torch.empty(cut.full, device="meta")
        target = whole if index is None else whole[index]
        if tuple(target.shape) != tuple(w.shape):
            raise ValueError(f"checkpoint tensor {name} has shape {list(w.shape)}; the "
                             f"{architecture} model config.json describes needs "
                             f"{list(target.shape)}")
        if cut is None:
            target.copy_(w)
        else:
            cut.load(params[pname], index, w)
        seen.add(key)
    missing = sorted(set(where) - seen)
    if missing:
        first = missing[0]
        for theirs, ours in renames:
            first = first.replace(ours, theirs)
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {first}")
