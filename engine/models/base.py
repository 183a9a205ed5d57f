"""The contract every model family implements, and the decoder stack they share.

The model holds weights only. The runner owns the KV cache and the attention backend
and passes both in a ForwardContext each step. A family builds a ``DecoderModel`` from
engine/layers/ parts and wraps it in a ``CausalLM``; everything else here (the layer
loop, interruption, the compiled segments, loading checkpoint tensors by the names its
linears declare) is common.

Segment protocol (what engine/compile/ compiles): a forward pass is cut at every
attention call into ``first`` (embedding, rotary tables, layer 0 up to its attention),
``middle`` (one layer's output and the next layer's q/k/v; one graph for all layers,
whose weights are its inputs) and ``last`` (the last layer's output and the final norm).
A short decode step runs instead as one graph (``decode_graph``): the segments and every
layer's attention with its KV write, which no per-layer check can interrupt; a longer one
may run as graphs of a few layers each (``decode_graph`` over a range of layers), with the
check between them.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, LayerAttention
from engine.attention.metadata import AttentionMetadata, DecodeSlots
from engine.config import ModelConfig
from engine.layers.attention import RopeTables
from engine.layers.decoder import DecoderLayer
from engine.layers.linear import Linear, single
from engine.layers.rotary import RotaryEmbedding
from engine.models.weights import checkpoint_map, load_tensors


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_")


@contextmanager
def meta_skeleton() -> Iterator[None]:
    """Modules built inside live on the meta device with no random init: every weight is
    loaded afterwards (``materialize`` then ``load_weights``). Plain ``torch.device("meta")``
    is not enough: a meta tensor's ``normal_`` (nn.Embedding's init) runs torch's Python
    reference, which imports torch._dynamo, 1.4 s of every worker's start-up even with
    compilation off. torch.nn.init's functions are swapped for a no-op while the
    skeleton is built (as transformers' ``no_init_weights`` does); built at start-up only."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in saved:
            setattr(nn.init, name, _no_init)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _no_init(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def materialize(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device=device)``, in place, without its Python detour: to_empty's
    ``empty_like`` of a meta tensor runs torch's Python reference, which imports sympy
    (0.4 s of every worker's start-up with compilation off). ``empty_strided`` makes the
    same uninitialised tensors (shape, strides, dtype) directly."""
    model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype,
                                               device=device))


@dataclass
class ForwardContext:
    """What one forward pass needs besides tokens: injected by the runner."""

    kv: torch.Tensor
    """[num_blocks, num_layers, 2, block_size, Hkv, D] — the whole paged cache."""
    meta: AttentionMetadata
    backend: AttentionBackend
    should_stop: Callable[[], bool] | None = None
    """Asked between layers; True abandons the pass (StepInterrupted)."""


class StepInterrupted(Exception):
    """A forward pass was abandoned between layers: a more important request arrived.
    Nothing of the step counts (its KV writes lie beyond every computed position)."""


def first_segment(model: DecoderModel, input_ids: torch.Tensor, positions: torch.Tensor):
    """Embedding, rotary tables and layer 0 up to its attention -> (x, rope, q, k, v)."""
    x = model.embed(input_ids)  # [T, H]
    rope = model.rope_tables(positions, x.dtype)
    return (x, rope, *model.layers[0].attn_in(x, rope))


def middle_segment(prev: DecoderLayer, nxt: DecoderLayer, x: torch.Tensor, o: torch.Tensor,
                   rope: RopeTables):
    """From one layer's attention to the next one's -> (x, q, k, v)."""
    x = prev.attn_out(x, o)
    return (x, *nxt.attn_in(x, rope))


def last_segment(prev: DecoderLayer, norm: nn.Module, x: torch.Tensor, o: torch.Tensor
                 ) -> torch.Tensor:
    """The last layer after its attention, and the final norm -> hidden [T, H]."""
    return norm(prev.attn_out(x, o))


def decode_graph(model: DecoderModel, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv: torch.Tensor, slots: DecodeSlots, lo: int, hi: int, carry: tuple | None
                 ) -> torch.Tensor | tuple:
    """Layers lo..hi-1 of a decode-only step as one graph (engine/compile/decode.py), each
    one's attention and KV write included (``Attention.attend_slots``). lo 0 starts from
    the embedding (``carry`` None); otherwise ``carry`` is what the group before gave. hi
    the last layer ends with the final norm -> hidden [R, H]; otherwise -> the carry
    (x, rope, q, k, v) for layer hi. Rows past the step's own are padding (``DecodeSlots``).
    Nothing asks should_stop inside: the caller may between groups (module docstring)."""
    layers = model.layers
    x, rope, q, k, v = first_segment(model, input_ids, positions) if lo == 0 else carry
    for i in range(lo, hi):
        o = layers[i].self_attn.attend_slots(q, k, v, kv, slots)
        if i + 1 < len(layers):
            x, q, k, v = middle_segment(layers[i], layers[i + 1], x, o, rope)
    if hi == len(layers):
        return last_segment(layers[-1], model.norm, x, o)
    return x, rope, q, k, v


def compile_blocker(model: nn.Module) -> str | None:
    """Why a model's decode step cannot be compiled, or None where it can: the first
    reason a layer declares (a class attribute ``not_compilable``: the MoE experts), named
    by module, so the runner skips compilation instead of failing at it."""
    for path, mod in model.named_modules():
        reason = getattr(type(mod), "not_compilable", None)
        if reason:
            return f"{getattr(model, 'architecture', type(model).__name__)}: {path}: {reason}"
    return None


@dataclass(frozen=True)
class Segments:
    """The three pieces of a forward pass between attention calls. Eager by default;
    engine/compile/ hands in compiled ones, and pads the rows to a bucket (``rows``
    real rows reach attention; the padding rows are computed and dropped)."""

    first: Callable = first_segment
    middle: Callable = middle_segment
    last: Callable = last_segment


EAGER = Segments()


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm, and the rotary tables the layers read
    (``model.`` in checkpoint names)."""

    def __init__(self, cfg: ModelConfig, layers: Sequence[DecoderLayer], norm: nn.Module,
                 rotaries: Sequence[RotaryEmbedding], embed_scale: float | None = None) -> None:
        """embed_scale: multiplies the embeddings (Gemma: sqrt(hidden), rounded to the
        activation dtype as transformers does)."""
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotaries = nn.ModuleList(rotaries)
        self.embed_scale = embed_scale

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        return tuple(r.tables(positions, dtype) for r in self.rotaries)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                seg: Segments = EAGER, rows: int | None = None,
                num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H]. With ``rows`` < T the
        last T - rows tokens are padding: they never reach attention or the KV cache.
        ctx.should_stop is asked before every layer but the first. ``num_layers`` runs
        only the first layers, then the final norm (a self-draft, engine/spec/draft.py)."""
        n = input_ids.shape[0] if rows is None else rows
        pad = input_ids.shape[0] - n
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        x, rope, q, k, v = seg.first(self, input_ids, positions)
        for i, layer in enumerate(layers):
            if i and ctx.should_stop is not None and ctx.should_stop():
                raise StepInterrupted
            if pad:
                q, k, v = q[:n], k[:n], v[:n]
            o = layer.self_attn.attend(q, k, v, ctx)  # [n, Hq * D]
            if pad:
                o = F.pad(o, (0, 0, 0, pad))
            if i + 1 < len(layers):
                x, q, k, v = seg.middle(layer, layers[i + 1], x, o, rope)
        return seg.last(layers[-1], self.norm, x, o)


class CausalLM(nn.Module):
    """A decoder stack and its LM head: what the runner, the compiled step and the
    draft proposer call. A family subclasses it to build its ``DecoderModel``."""

    architecture = "base"
    ignored: tuple[str, ...] = ("rotary_emb.",)
    """Checkpoint tensors holding nothing to load (recomputed buffers)."""
    renames: tuple[tuple[str, str], ...] = ()
    """(checkpoint name part, ours): where a family's checkpoints name a module otherwise
    than the shared layers do (Mixtral's ``block_sparse_moe`` is our ``mlp``)."""

    def __init__(self, cfg: ModelConfig, model: DecoderModel,
                 final_softcap: float | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = model
        self.lm_head = single(cfg.hidden_size, cfg.vocab_size, "lm_head")
        self.final_softcap = final_softcap
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                seg: Segments = EAGER, rows: int | None = None,
                num_layers: int | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, ctx, seg, rows, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> fp32 logits [N, V] (only the rows the sampler needs), soft-capped
        where the family caps them (Gemma 2)."""
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    def attention_params(self) -> Iterator[LayerAttention]:
        """Every layer's attention parameters (the runner has the backend check each)."""
        for layer in self.model.layers:
            yield layer.self_attn.params

    def checkpoint_names(self, module_path: str) -> list[str]:
        """Checkpoint tensors that make up one linear layer's weight, in shard order
        (``model.layers.0.self_attn.qkv_proj`` -> its q, k and v projections)."""
        if module_path == "lm_head" and self.cfg.tie_word_embeddings:
            return ["model.embed_tokens.weight"]
        mod = self.get_submodule(module_path)
        if not isinstance(mod, Linear):
            return [module_path + ".weight"]
        parent = module_path.rpartition(".")[0]
        return [f"{parent}.{name}.weight".lstrip(".") for name, _ in mod.shards]

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint-named tensors into place. Raises ValueError naming the tensor
        on one with no place, one of the wrong shape, or one missing."""
        where = checkpoint_map(self, skip={"lm_head.weight"} if self.cfg.tie_word_embeddings
                               else set())
        ignored = self.ignored + (("lm_head.weight",) if self.cfg.tie_word_embeddings else ())
        load_tensors(self, where, tensors, ignored, self.architecture, self.renames)
