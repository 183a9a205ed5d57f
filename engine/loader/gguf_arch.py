"""GGUF architectures (llama.cpp's ``general.architecture``) -> Tandem's families: the
model config from the file's metadata and each tensor's HF checkpoint name.

Tensor names come from the ``gguf`` package's own table (``TENSOR_NAMES``: the names
llama.cpp's converter writes); the HF side is the checkpoint layout each family loads
(engine/models/). What llama.cpp's converter does to tensors, and we undo:
- llama (and the Mistral and Mixtral files converted as llama): q/k rows permuted per
  head (``permute_qk``); no other architecture is permuted.
- gemma2 / gemma3: every ``*norm.weight`` holds w + 1 (Gemma's (1 + w) norm folded into
  the weight; ``norm_shift``), as transformers' GGUF loader also undoes.
- phi3: q/k/v and gate/up stay fused (``attn_qkv``, ``ffn_up``), as in HF's checkpoint.
- MoE: experts stacked per layer (``ffn_{gate,up,down}_exps`` [E, out, in]); the loader
  yields them per expert under the HF names.
What llama.cpp infers rather than stores (Gemma's attention scale, Gemma 3's local
rotary base and layer pattern, Qwen3-MoE's renormalised top-k) is inferred here the way
llama.cpp does it, so a file computes what llama.cpp computes from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import MODEL_TENSOR as T
from gguf import TENSOR_NAMES, GGUFReader

L = "model.layers.{bid}."
_GLOBAL = {T.TOKEN_EMBD: "model.embed_tokens", T.OUTPUT_NORM: "model.norm", T.OUTPUT: "lm_head"}
_ATTN = {T.ATTN_NORM: L + "input_layernorm", T.ATTN_Q: L + "self_attn.q_proj",
         T.ATTN_K: L + "self_attn.k_proj", T.ATTN_V: L + "self_attn.v_proj",
         T.ATTN_OUT: L + "self_attn.o_proj"}
_MLP = {T.FFN_NORM: L + "post_attention_layernorm", T.FFN_GATE: L + "mlp.gate_proj",
        T.FFN_UP: L + "mlp.up_proj", T.FFN_DOWN: L + "mlp.down_proj"}
_QK_NORM = {T.ATTN_Q_NORM: L + "self_attn.q_norm", T.ATTN_K_NORM: L + "self_attn.k_norm"}
_SANDWICH = {T.ATTN_POST_NORM: L + "post_attention_layernorm",
             T.FFN_PRE_NORM: L + "pre_feedforward_layernorm",  # llama.cpp's ffn_norm
             T.FFN_POST_NORM: L + "post_feedforward_layernorm"}
_PHI3 = {T.ATTN_QKV: L + "self_attn.qkv_proj", T.FFN_UP: L + "mlp.gate_up_proj"}
_ROPE_FACTORS = (T.ROPE_FACTORS_LONG, T.ROPE_FACTORS_SHORT)
"""Phi-3's longrope factors: read into the config (rope_scaling), not loaded as weights."""


def _moe(block: str, gate: str, up: str, down: str) -> dict[T, str]:
    """A sparse block's router and stacked experts ("{e}": the expert, split at load)."""
    experts = L + block + ".experts.{e}."
    return {T.FFN_GATE_INP: L + block + ".gate", T.FFN_GATE_EXP: experts + gate,
            T.FFN_UP_EXP: experts + up, T.FFN_DOWN_EXP: experts + down}


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF architecture maps onto a family."""

    tensors: dict[T, str]
    """llama.cpp tensor -> HF module name ("{bid}" the layer, "{e}" an expert)."""
    permute_qk: bool = False
    """llama.cpp permuted the q/k rows (llama only)."""
    norm_shift: float = 0.0
    """What the file added to every norm weight (Gemma: 1)."""
    config: Any = field(default=None, compare=False)
    """(Meta, num_layers) -> (family, extra config fields, ModelConfig overrides)."""


def _llama(m: "Meta", n: int) -> tuple[str, dict, dict]:
    """llama files hold Llama, Mistral (a sliding window, where the file has one) and
    Mixtral (experts)."""
    experts = m.get("expert_count") or 0
    if experts:
        return "mixtral", {"num_local_experts": experts,
                           "num_experts_per_tok": m.need("expert_used_count")}, {}
    return ("mistral" if m.get("attention.sliding_window") else "llama"), {}, {}


def _qwen(family: str):
    return lambda m, n: (family, {}, {})


def _qwen3_moe(m: "Meta", n: int) -> tuple[str, dict, dict]:
    dense = [i for i in range(n) if f"blk.{i}.ffn_gate.weight" in m.tensor_names]
    return "qwen3_moe", {
        "num_experts": m.need("expert_count"), "num_experts_per_tok": m.need("expert_used_count"),
        "moe_intermediate_size": m.need("expert_feed_forward_length"),
        # llama.cpp renormalises Qwen3-MoE's top-k weights unless the file says otherwise
        "norm_topk_prob": bool(m.get("expert_weights_norm", True)),
        "mlp_only_layers": dense}, {}


def _attn_scalar(m: "Meta", n: int, big: int) -> float:
    """Gemma's query_pre_attn_scalar, which GGUF does not store: llama.cpp takes
    hidden / heads for the 27B models (``big`` layers) and head_dim for the others (the
    values their HF configs hold), or the file's attention.scale where it has one."""
    scale = m.get("attention.scale")
    if scale:
        return float(scale) ** -2
    if n == big:
        return m.need("embedding_length") / m.need("attention.head_count")
    return float(m.head_dim)


def _gemma2(m: "Meta", n: int) -> tuple[str, dict, dict]:
    return "gemma2", {"query_pre_attn_scalar": _attn_scalar(m, n, 46),
                      "attn_logit_softcapping": m.get("attn_logit_softcapping"),
                      "final_logit_softcapping": m.get("final_logit_softcapping")}, \
        {"hidden_act": "gelu_pytorch_tanh"}


def _gemma3(m: "Meta", n: int) -> tuple[str, dict, dict]:
    """Local layers: llama.cpp's pattern (every 6th layer global) and local rotary base
    (10,000) unless the file names its own."""
    extra = {"query_pre_attn_scalar": _attn_scalar(m, n, 62),
             "rope_local_base_freq": float(m.get("rope.freq_base_swa", 10000.0)),
             "attn_logit_softcapping": m.get("attn_logit_softcapping"),
             "final_logit_softcapping": m.get("final_logit_softcapping")}
    pattern = m.get("attention.sliding_window_pattern")
    overrides: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh"}
    if isinstance(pattern, list):  # per layer: true where it slides
        if len(pattern) != n:
            raise ValueError(f"{m.path}: gemma3.attention.sliding_window_pattern lists "
                             f"{len(pattern)} layers, block_count is {n}")
        overrides["layer_types"] = tuple("sliding_attention" if s else "full_attention"
                                         for s in pattern)
    elif pattern:
        extra["sliding_window_pattern"] = int(pattern)
    return "gemma3", extra, overrides


def _phi3(m: "Meta", n: int) -> tuple[str, dict, dict]:
    return "phi3", {}, {}


ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch({**_GLOBAL, **_ATTN, **_MLP,
                       **_moe("block_sparse_moe", "w1", "w3", "w2")}, permute_qk=True,
                      config=_llama),
    "qwen2": GGUFArch({**_GLOBAL, **_ATTN, **_MLP}, config=_qwen("qwen2")),
    "qwen3": GGUFArch({**_GLOBAL, **_ATTN, **_MLP, **_QK_NORM}, config=_qwen("qwen3")),
    "gemma2": GGUFArch({**_GLOBAL, **_ATTN, **_MLP, **_SANDWICH}, norm_shift=1.0,
                       config=_gemma2),
    "gemma3": GGUFArch({**_GLOBAL, **_ATTN, **_MLP, **_SANDWICH, **_QK_NORM}, norm_shift=1.0,
                       config=_gemma3),
    "phi3": GGUFArch({**_GLOBAL, **_ATTN, **_MLP, **_PHI3}, config=_phi3),
    "qwen3moe": GGUFArch({**_GLOBAL, **_ATTN, **_MLP, **_QK_NORM,
                          **_moe("mlp", "gate_proj", "up_proj", "down_proj")},
                         config=_qwen3_moe),
}
"""general.architecture -> how its files load (anything else is refused, naming it)."""


class Meta:
    """A GGUF file's metadata under its architecture's prefix; ``need`` raises naming
    the file and the key."""

    def __init__(self, reader: GGUFReader, path: Path, arch: str) -> None:
        self.reader, self.path, self.prefix = reader, path, arch + "."
        self.tensor_names = {t.name for t in reader.tensors}
        self.head_dim = 0  # set once the head counts are read

    def raw(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw(self.prefix + key, default)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: the GGUF metadata key {self.prefix + key!r} "
                             f"is missing")
        return value


def gguf_arch(reader: GGUFReader, path: Path) -> tuple[str, GGUFArch]:
    """The file's architecture and how it loads; ValueError naming the file and the
    architecture, listing the supported ones, for any other."""
    f = reader.fields.get("general.architecture")
    arch = None if f is None else f.contents()
    if arch not in ARCHS:
        raise ValueError(f"{path}: general.architecture is {arch!r}, which Tandem does not "
                         f"load from GGUF (supported: {', '.join(ARCHS)})")
    return arch, ARCHS[arch]


def tensor_names(spec: GGUFArch, num_layers: int) -> dict[str, str]:
    """Every GGUF tensor base name the architecture may hold -> its HF name."""
    out: dict[str, str] = {}
    for kind, hf in spec.tensors.items():
        gguf = TENSOR_NAMES[kind]
        for bid in (range(num_layers) if "{bid}" in gguf else (0,)):
            out[gguf.format(bid=bid)] = hf.replace("{bid}", str(bid))
    return out


ROPE_FACTOR_NAMES = tuple(TENSOR_NAMES[t] + ".weight" for t in _ROPE_FACTORS)
