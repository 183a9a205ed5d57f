"""A PEFT LoRA adapter read from its directory: ``adapter_config.json`` (r, lora_alpha,
use_rslora, target_modules, rank_pattern) and ``adapter_model.safetensors`` (each target
module's ``lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r]).

Only what changes a linear's output by ``scaling * B @ A @ x`` is taken. Whatever PEFT
can express beyond that (DoRA, LoRA biases, modules_to_save, per-module alphas, embedding
adapters, fan_in_fan_out layers) is refused at load, naming the field, rather than
served as something else. The scaling (alpha / r, or alpha / sqrt(r) under rsLoRA, with
each module's own r under a rank_pattern) is folded into B here, once.

``identity`` is a sha256 over the config's and the weights' bytes: it salts the adapter's
block hashes (engine/lora/registry.py), so a prefix cached under one adapter, or under
another file loaded under the same name, is never served to another.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the base model's own module names in the weights file."""


class AdapterError(ValueError):
    """An adapter this server cannot serve: the message names the adapter, the field
    of adapter_config.json or the flag (--max-lora-rank) at fault."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    """The config's r (the largest a rank_pattern may differ from it is checked too)."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Base module name (``model.layers.0.self_attn.q_proj``) -> (A [r, in], scaling * B
    [out, r]), fp32 on the host."""
    target_modules: tuple[str, ...] | str
    base_model: str | None
    identity: bytes
    placed: dict = field(default_factory=dict)
    """Filled by the model side (engine/lora/layers.py place): our linear's path ->
    [(shard index, A, B)], the tensors as a resident slot takes them."""


def _refuse(name: str, cfg: dict) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name}: peft_type {cfg.get('peft_type')!r} is not LORA")
    checks = [("use_dora", bool(cfg.get("use_dora")), "DoRA"),
              ("bias", cfg.get("bias", "none") != "none", "LoRA biases"),
              ("lora_bias", bool(cfg.get("lora_bias")), "LoRA biases"),
              ("modules_to_save", bool(cfg.get("modules_to_save")), "fully trained modules"),
              ("alpha_pattern", bool(cfg.get("alpha_pattern")), "per-module alphas"),
              ("fan_in_fan_out", bool(cfg.get("fan_in_fan_out")), "transposed (Conv1D) layers"),
              ("layer_replication", bool(cfg.get("layer_replication")), "layer replication")]
    for key, bad, what in checks:
        if bad:
            raise AdapterError(f"adapter {name}: adapter_config.json {key}={cfg[key]!r}: "
                               f"{what} are not supported (plain LoRA only)")


def _split_key(name: str, key: str) -> tuple[str, str]:
    """``base_model.model.X.lora_A.weight`` -> (X, "A")."""
    inner = key.removeprefix(PEFT_PREFIX)
    for part in ("A", "B"):
        for tail in (f".lora_{part}.weight", f".lora_{part}.default.weight"):
            if inner.endswith(tail):
                return inner[: -len(tail)], part
    raise AdapterError(f"adapter {name}: {WEIGHTS_FILE} holds {key}, which is not a "
                       f"lora_A/lora_B weight of a linear (embedding adapters, DoRA "
                       f"magnitudes and saved modules are not supported)")


def _scaling(cfg: dict, rank: int) -> float:
    alpha = float(cfg.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def load_adapter(name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    """Read and check one adapter directory. AdapterError naming the field or flag."""
    from safetensors.torch import load_file

    root = Path(path)
    if not (root / CONFIG_FILE).is_file() or not (root / WEIGHTS_FILE).is_file():
        raise AdapterError(f"adapter {name}: {root} must hold {CONFIG_FILE} and {WEIGHTS_FILE} "
                           f"(a PEFT LoRA adapter saved with safetensors)")
    raw_cfg, raw_weights = (root / CONFIG_FILE).read_bytes(), (root / WEIGHTS_FILE).read_bytes()
    cfg = json.loads(raw_cfg)
    _refuse(name, cfg)
    rank = int(cfg.get("r", 8))
    ranks = [rank, *map(int, (cfg.get("rank_pattern") or {}).values())]
    if max(ranks) > max_rank:
        raise AdapterError(f"adapter {name}: r {max(ranks)} (adapter_config.json r/rank_pattern) "
                           f"exceeds --max-lora-rank {max_rank}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(root / WEIGHTS_FILE)).items():
        module, part = _split_key(name, key)
        pairs.setdefault(module, {})[part] = t.float()
    weights = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != ab["B"].shape[1]:
            raise AdapterError(f"adapter {name}: {module} needs lora_A [r, in] and lora_B "
                               f"[out, r] of one rank")
        if ab["A"].shape[0] > max_rank:
            raise AdapterError(f"adapter {name}: {module} has rank {ab['A'].shape[0]}, beyond "
                               f"--max-lora-rank {max_rank}")
        weights[module] = (ab["A"], ab["B"] * _scaling(cfg, ab["A"].shape[0]))
    targets = cfg.get("target_modules") or ()
    digest = hashlib.sha256(b"tandem-lora/v1\x00" + hashlib.sha256(raw_cfg).digest()
                            + hashlib.sha256(raw_weights).digest()).digest()
    return LoRAAdapter(name, str(root), rank, weights,
                       targets if isinstance(targets, str) else tuple(targets),
                       cfg.get("base_model_name_or_path"), digest)
