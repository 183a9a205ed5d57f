"""Checkpoint tensors -> model parameters, by the names each layer declares.

A ``Linear`` (engine/layers/linear.py) says which checkpoint tensors stack into it; any
other parameter is filled by the tensor of its own name. So a family declares its
checkpoint layout once, where it builds its layers, and loading needs no table of its own.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

from engine.layers.linear import Linear

Place = tuple[str, object]
"""(parameter name, the index into it a tensor fills: a row slice, or None for all)."""


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
        target = params[pname] if index is None else params[pname][index]
        if tuple(target.shape) != tuple(w.shape):
            raise ValueError(f"checkpoint tensor {name} has shape {list(w.shape)}; the "
                             f"{architecture} model config.json describes needs "
                             f"{list(target.shape)}")
        target.copy_(w)
        seen.add(key)
    missing = sorted(set(where) - seen)
    if missing:
        first = missing[0]
        for theirs, ours in renames:
            first = first.replace(ours, theirs)
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {first}")
