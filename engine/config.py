"""Configuration: the model's shape (read from the checkpoint) and the engine's knobs.

The knobs come in frozen groups by concern (LoadConfig, CacheConfig, SchedulerConfig,
QuantConfig, SpecConfig, CompileConfig) composed into EngineConfig. Each validates its
own fields in ``__post_init__`` and EngineConfig the checks that span groups; a bad value
raises ValueError naming the flag, so a user sees which one to fix.
"""
from __future__ import annotations

import hashlib
import json
import os
import typing
from dataclasses import Field, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from engine.attention.registry import ATTENTION_BACKENDS
from core.kv.layout import KV_CACHE_DTYPES, is_quantized
from core.kv.policy import parse_kv_policy
from core.states import PreemptionMode

if TYPE_CHECKING:  # torch loads only when a dtype is resolved: `tandem --help` stays quick
    import torch


PREEMPTION_MODES = ("auto", *(m.value for m in PreemptionMode))
"""--preemption-mode's choices: auto, or a PreemptionMode forced."""
ACTIVATION_QUANTS = ("none", "int8")
"""--activation-quant: how packed weights see the activations (QuantConfig)."""


def at_least(flag: str, value: float | None, low: float) -> None:
    """Refuse a flag's value below ``low`` (None, where a flag allows it, is unset)."""
    if value is not None and value < low:
        raise ValueError(f"{flag} must be >= {low}, got {value}")


def one_of(flag: str, value: Any, choices: typing.Iterable[Any]) -> None:
    """Refuse a flag's value outside its choices, listing them."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(map(str, choices))}; got {value!r}")


def config_number(value: Any, key: str, source: str, kind: type = int) -> Any:
    """A checkpoint config's numeric field as ``kind`` (int: a whole number; float: any
    number); ValueError naming the file and the field for anything else ("four", true,
    a list, 2.5 for an int), never a bare conversion error."""
    whole = isinstance(value, float) and value.is_integer()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and isinstance(value, float) and not whole):
        wanted = "a whole number" if kind is int else "a number"
        raise ValueError(f"{source or 'model config'}: the field {key!r} is {value!r}; "
                         f"expected {wanted}")
    return kind(value)


_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads"}
"""ModelConfig fields that config.json names otherwise (errors use config.json's name)."""


@dataclass(frozen=True)
class ModelConfig:
    """A model's hyperparameters, as stored in a GGUF header or config.json: the fields
    every family reads, and ``extra`` for those only some families read (``need``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """HF-style rope_scaling dict (``rope_type`` linear | llama3 | yarn | longrope), or None."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"
    architecture: str = "llama"
    """The model family, a key of engine.models.MODELS."""
    hidden_act: str = "silu"
    """The MLP gate's nonlinearity (engine/layers/activation.py GATES)."""
    attention_bias: bool = False
    """q/k/v/o projections carry biases (Llama's attention_bias)."""
    sliding_window: int | None = None
    """Keys a sliding layer sees (itself included); None: no layer slides."""
    layer_types: tuple[str, ...] | None = None
    """Per layer "full_attention" or "sliding_attention" where config.json lists them;
    None: the family's default."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The config.json fields not above, read by the families that need them."""
    source: str = field(default="", compare=False)
    """The file this config came from (errors name it); not part of the fingerprint."""

    def __post_init__(self) -> None:
        where = self.source or "model config"
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, f) < 1:
                raise ValueError(f"{where}: {_HF_NAMES.get(f, f)} must be >= 1, "
                                 f"got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{where}: num_attention_heads ({self.num_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_kv_heads})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{where}: sliding_window must be >= 1 or null, "
                             f"got {self.sliding_window}")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"{self.source}: layer_types lists {len(self.layer_types)} layers, "
                             f"num_hidden_layers is {self.num_layers}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def get(self, key: str, default: Any = None) -> Any:
        """An extra config field, or default when the checkpoint has none (or null)."""
        value = self.extra.get(key)
        return default if value is None else value

    def need(self, key: str, kind: type = int) -> Any:
        """An extra numeric config field this family cannot run without, as ``kind``;
        ValueError naming the file and the field when the checkpoint lacks it or it is
        not a number (config_number)."""
        if self.extra.get(key) is None:
            raise ValueError(f"{self.source or 'model config'}: the {self.architecture} "
                             f"architecture needs the field {key!r}, which is missing")
        return config_number(self.extra[key], key, self.source, kind)

    def layer_window(self, layer: int, sliding_by_default: bool) -> int | None:
        """This layer's sliding window, or None where it attends to everything:
        config.json's layer_types says whether it slides, else the family's default."""
        default = "sliding_attention" if sliding_by_default else "full_attention"
        kind = self.layer_types[layer] if self.layer_types else default
        if kind == "full_attention":
            return None
        if kind != "sliding_attention":
            raise ValueError(f"{self.source}: layer_types[{layer}] is {kind!r} (supported: "
                             f"full_attention, sliding_attention)")
        if self.sliding_window is None:
            raise ValueError(f"{self.source}: layer {layer} slides (layer_types) but the "
                             f"field 'sliding_window' is missing")
        return self.sliding_window

    def fingerprint(self) -> str:
        """Stable short hash of the architecture (the weights add their own digest)."""
        shape = {k: v for k, v in asdict(self).items() if k != "source"}
        blob = json.dumps(shape, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
           "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has AMX or AVX512-BF16 (bf16 matmuls beat fp32 there), as the
    capability ceiling lets Tandem see it (engine/native.py)."""
    from engine.native import cpu_flags

    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """``auto`` is bf16 on CUDA and on CPUs with AMX/avx512_bf16, fp32 elsewhere."""
    import torch

    if name == "auto":
        if device.startswith("cuda") or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {name!r}")
    return getattr(torch, _DTYPES[name])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class LoadConfig:
    """What to load and how it runs."""

    model: str = ""
    """Path to a .gguf file or an HF directory (config.json + *.safetensors); empty = default model."""
    dtype: str = "auto"
    """Compute dtype (and the KV dtype under --kv-cache-dtype auto): auto (bf16 where the
    hardware has fast bf16), float32, bfloat16."""
    device: str = "cpu"
    """torch device: cpu or cuda[:N]."""
    max_model_len: int | None = None
    """Context window (prompt + output); None = the model's own, capped at 8192."""
    attention_backend: str = "auto"
    """auto (flash_attn where CUDA and the package are, else sdpa), or a name of the
    attention-backend registry: sdpa, flash_attn, naive."""
    num_threads: int | None = None
    """torch intra-op threads; None: one per core this process may run on, capped at
    the container's CPU limit (cgroup cpu.max, rounded up)."""
    prepack_weights: bool = True
    """Keep each linear's dense weight a second time, prepacked for oneDNN's GEMMs (CPU,
    bf16/fp32; engine/layers/dense.py): 32-row decode GEMMs about 1.45x faster (bench/
    dense_gemm.py), for the dense weights' bytes once more; --no-prepack-weights multiplies the
    plain weights."""

    def __post_init__(self) -> None:
        at_least("--max-model-len", self.max_model_len, 1)
        ATTENTION_BACKENDS.check(self.attention_backend, extra=("auto",))
        resolve_dtype(self.dtype, self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.device)


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache: its blocks, pool, storage, prefix reuse and host swap pool."""

    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool; None sizes it from kv_cache_memory_gib."""
    kv_cache_memory_gib: float = 1.0
    """KV pool size in GiB when num_kv_blocks is not given (blocks = this // the block's
    bytes, so a quantized --kv-cache-dtype holds about twice the tokens)."""
    kv_cache_dtype: str = "auto"
    """How the KV cache stores K and V: auto (the compute dtype), bfloat16 | float32 (must
    equal the compute dtype), int8 (per token and KV head scales stored in each block, about
    half the bytes), fp8_e4m3 (the same with fp8 codes; CUDA only)."""
    enable_prefix_caching: bool = True
    """Reuse cached full blocks with equal chained hashes (and equal tokens)."""
    swap_space: float = 1.0
    """Host (CPU) swap pool for preempted requests' KV blocks, GiB; pinned memory on CUDA."""
    hash_seed: int = 0
    """Seed of the chained block hashes; every process of one cluster must agree."""
    kv_offload_cpu_gib: float = 0.0
    """Host-memory KV tier, GiB: prefix blocks evicted from the device pool are kept here
    (LRU by block hash) and promoted back on a hit; it also fills the swap pool's idle
    space, which swapping reclaims first (docs/kv-offload.md). 0 = off."""
    kv_offload_dir: str = ""
    """Disk KV tier: a directory for blocks evicted from the host tier, kept across
    restarts of the same model (fingerprint, KV format and checksum in each file); empty
    = off. Needs --kv-offload-cpu-gib > 0."""
    kv_offload_disk_gib: float = 16.0
    """Most GiB the disk tier's files take in --kv-offload-dir (LRU)."""
    kv_policy: str = "full"
    """What a request's KV cache keeps: full (every token), streaming:sinks=S,window=W
    (StreamingLLM: the first S tokens and the newest, S + W tokens in whole blocks, with
    positions within the cache; a request may then run past --max-model-len, up to
    --max-stream-len), or h2o:heavy=H,recent=R[,sinks=S][,halflife=T][,score=mean] (H2O:
    per layer and KV head the R newest tokens and the H with the most accumulated
    attention; sinks: the first S tokens kept besides; halflife: attention accumulated T
    tokens ago counts half; score=mean: ranked by attention per query seen, not the
    sum)."""
    allow_request_kv_policy: bool = False
    """Let a request choose its own kv_policy (else a request naming another policy than
    --kv-policy is refused)."""
    max_stream_len: int = 1 << 20
    """Most tokens (prompt + output) of a request under a bounded KV policy."""

    def __post_init__(self) -> None:
        self._check_offload()
        parse_kv_policy(self.kv_policy, "--kv-policy")
        at_least("--max-stream-len", self.max_stream_len, 2)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two >= 1, got {self.block_size}")
        at_least("--kv-blocks", self.num_kv_blocks, 1)
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"--kv-cache-memory-gib must be > 0, got {self.kv_cache_memory_gib}")
        one_of("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)

    def _check_offload(self) -> None:
        at_least("--kv-offload-cpu-gib", self.kv_offload_cpu_gib, 0)
        if self.kv_offload_disk_gib <= 0:
            raise ValueError(f"--kv-offload-disk-gib must be > 0, got {self.kv_offload_disk_gib}")
        if self.kv_offload_dir and not self.kv_offload_cpu_gib:
            raise ValueError("--kv-offload-dir needs --kv-offload-cpu-gib > 0: blocks reach "
                             "the disk tier through the host tier")
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        want = (self.kv_offload_cpu_gib + self.swap_space) * (1 << 30)
        if self.kv_offload_cpu_gib and want > host:  # without tiers, as before: no check
            raise ValueError(f"--kv-offload-cpu-gib {self.kv_offload_cpu_gib} with --swap-space "
                             f"{self.swap_space} asks for more host memory than this machine "
                             f"has ({host / (1 << 30):.1f} GiB)")


@dataclass(frozen=True)
class SchedulerConfig:
    """What each step runs: batch limits, chunking, priorities and preemption."""

    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 512
    """Per-step token budget (prefill chunks + decode tokens)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    preemption_mode: str = "auto"
    """swap | recompute | auto (swap, but recompute short contexts or when the swap pool is full)."""
    priority_batch_cap: int = 2
    """When requests of several priorities are running or waiting, at most this many
    decode rows less important than the best of them join each step (protects the best
    class's TTFT and inter-token latency; the rest keep their KV and wait, and still
    advance this many at a time); 0 = no cap. No effect when all priorities are equal."""
    interrupt_steps: bool = True
    """Abandon a running step between layers when a request more important than all of
    its requests arrives (the newcomer then waits one layer, not one step)."""

    def __post_init__(self) -> None:
        at_least("--max-num-seqs", self.max_num_seqs, 1)
        at_least("--max-num-batched-tokens", self.max_num_batched_tokens, 1)
        at_least("--priority-batch-cap", self.priority_batch_cap, 0)
        one_of("--preemption-mode", self.preemption_mode, PREEMPTION_MODES)


@dataclass(frozen=True)
class QuantConfig:
    """How the linear weights are stored and run."""

    quantization: str = "auto"
    """Linear weights: auto (a GGUF's Q4_0/Q4_1/Q8_0 tensors stay packed, but a MoE GGUF's
    are dequantized: no packed kernel for its experts; an HF checkpoint runs as stored),
    none (dequantize at load), int8 | int4 (quantize every linear at load), gguf (keep a
    GGUF's tensors packed; refused for MoE). Packed weights run through fused weight-only kernels at
    small batch and keep a dense copy for large ones."""
    quant_group_size: int = 32
    """Weights per scale/zero group of --quantization int4 (32, 64, 128 or 256)."""
    quant_packed_max_rows: int | None = None
    """Steps of at most this many tokens use the packed int kernels, larger ones the dense
    weights; None = measured at start-up per weight shape (0 = always dense)."""
    activation_quant: str = "none"
    """none (packed weights multiply the activations as they are: the file's exact
    product) or int8: quantize each activation row to int8 per block of 32 (one fp32 scale
    each), as llama.cpp does, and multiply the packed blocks with integer dot products
    (AVX2; lossy, so only on request)."""

    def __post_init__(self) -> None:
        from engine.quant.base import METHODS  # torch-only module; keeps config import light
        one_of("--quantization", self.quantization, METHODS)
        one_of("--quant-group-size", self.quant_group_size, (32, 64, 128, 256))
        at_least("--quant-packed-max-rows", self.quant_packed_max_rows, 0)
        one_of("--activation-quant", self.activation_quant, ACTIVATION_QUANTS)
        if self.activation_quant != "none" and self.quantization == "none":
            raise ValueError(f"--activation-quant {self.activation_quant} multiplies packed "
                             "weights, and --quantization none packs none; drop one of them")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding."""

    speculative_method: str = "none"
    """Speculative decoding: none, ngram (prompt lookup), suffix (suffix match over the
    context and recent outputs), or draft (a draft model: --speculative-model). Proposals
    are verified in one forward pass; outputs are exactly those of plain decoding."""
    speculative_model: str = ""
    """--speculative-method draft: a smaller model sharing the tokenizer (a .gguf file or
    an HF directory), or self:N (the target's own first N layers and its LM head)."""
    num_speculative_tokens: int = 7
    """Most tokens proposed per request per step (K); each step verifies K+1 positions
    (fewer when several requests speculate: a step's rows stay within 32)."""
    speculative_max_batch: int = 8
    """Speculation is off in steps with more decode rows than this (verifying costs more
    than it saves once the batch fills the matmuls); 0 = no limit."""

    def __post_init__(self) -> None:
        from engine.spec.registry import PROPOSERS  # torch-free
        PROPOSERS.check(self.speculative_method, extra=("none",))
        if self.speculative_method == "none":
            return
        if self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1 with "
                             f"--speculative-method {self.speculative_method}, "
                             f"got {self.num_speculative_tokens}")
        at_least("--speculative-max-batch", self.speculative_max_batch, 0)
        if (self.speculative_method == "draft") != bool(self.speculative_model):
            raise ValueError("--speculative-model is required by --speculative-method draft "
                             "and only used by it")


@dataclass(frozen=True)
class CompileConfig:
    """The compiled decode step."""

    compile: bool = os.environ.get("TANDEM_COMPILE", "1") != "0"
    """Compile the decode step at start-up (torch.compile per bucketed batch size 1, 2, 4,
    ... up to --compile-max-batch; CUDA graphs on GPU), and on CPU the steps with a prefill
    for any row count; --no-compile runs every step eagerly.
    TANDEM_COMPILE=0 in the environment makes --no-compile the default (the test suite's)."""
    compile_max_batch: int | None = None
    """Largest compiled decode batch (bigger decode batches run eagerly); None = max_num_seqs."""
    compile_graph_max_batch: int = 4
    """Compiled decode steps of up to this many rows run as one graph, attention and KV
    writes included (CPU, the sdpa backend, a KV cache in the compute dtype, no LoRA):
    faster, but step interruption waits for the step's end; larger ones are compiled per
    layer and stay interruptible between layers. 0: per layer always."""
    compile_graph_layers: int = 0
    """Compiled decode steps of more rows than --compile-graph-max-batch run as graphs of
    this many layers each, attention and KV writes included, interruptible between
    graphs (CPU, where one-graph steps can run): 32-row decode steps of the embedded model
    about 12% faster with 10, at about 20 s more compilation per batch size at a first
    start. 0: per layer."""

    def __post_init__(self) -> None:
        at_least("--compile-max-batch", self.compile_max_batch, 1)
        at_least("--compile-graph-max-batch", self.compile_graph_max_batch, 0)
        at_least("--compile-graph-layers", self.compile_graph_layers, 0)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (engine/lora/)."""

    enable_lora: bool = False
    """Serve PEFT LoRA adapters on top of the base model, chosen per request by its model
    field (on whenever --lora-modules names one)."""
    lora_modules: tuple[str, ...] = ()
    """Adapters served from start: name=PATH ... (PATH: a PEFT adapter directory,
    adapter_config.json + adapter_model.safetensors)."""
    max_loras: int = 4
    """Adapters resident at once, hence distinct adapters in one batch (requests for more
    wait their turn)."""
    max_lora_rank: int = 16
    """Largest adapter rank served (an adapter of higher rank is refused)."""
    max_cpu_loras: int | None = None
    """Adapters kept in host memory (least recently used read again from disk on demand);
    None = --max-loras."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        at_least("--max-loras", self.max_loras, 1)
        at_least("--max-lora-rank", self.max_lora_rank, 1)
        at_least("--max-cpu-loras", self.max_cpu_loras, self.max_loras)
        for item in self.lora_modules:
            name, eq, path = item.partition("=")
            if not (name and eq and path):
                raise ValueError(f"--lora-modules takes name=PATH items, got {item!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def modules(self) -> list[tuple[str, str]]:
        """(name, path) of each --lora-modules item."""
        return [tuple(item.split("=", 1)) for item in self.lora_modules]  # type: ignore[misc]

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices (processes) one engine's model is split over."""

    tensor_parallel_size: int = 1
    """Ranks the model is split over (one process each, torch.distributed: gloo on CPU,
    NCCL on CUDA): attention heads, MLP and expert widths, and the vocabulary are divided
    among them, and each rank's KV pool holds only its KV heads. 1 runs in this process
    alone (docs/tensor-parallel.md)."""

    tp_rendezvous: str | None = None
    """HOST:PORT of rank 0's TCP store for a group whose ranks sit in other pods or
    machines (started there by `tandem tp-follower`): rank 0 listens on PORT on every
    interface, starts only its own node's ranks (--tp-ranks-per-node) and waits for the
    rest. None: rank 0 starts every rank itself on this machine (docs/tensor-parallel.md)."""
    tp_ranks_per_node: int | None = None
    """Ranks each node (pod) of a --tp-rendezvous group runs, one per device: node 0
    (rank 0's) runs ranks 0..K-1, node i ranks i*K..i*K+K-1. None: 1 with
    --tp-rendezvous, every rank without."""
    tp_join_timeout_s: float = 300.0
    """With --tp-rendezvous: seconds rank 0 waits for every other rank to join, and a
    follower rank keeps trying to reach rank 0's store."""
    enable_expert_parallel: bool = False
    """At --tensor-parallel-size > 1, split a mixture-of-experts layer by experts (each
    rank keeps E / N whole experts and runs the tokens routed to them; the sum over ranks
    is the all-reduce the layer ends with anyway) instead of splitting every expert's
    width. Whole experts run wider matmuls; the ranks' loads then follow the routing
    (docs/tensor-parallel.md has the measurements). No effect at 1 or on dense models."""

    def __post_init__(self) -> None:
        at_least("--tensor-parallel-size", self.tensor_parallel_size, 1)
        if self.tp_join_timeout_s <= 0:
            raise ValueError(f"--tp-join-timeout-s must be > 0, got {self.tp_join_timeout_s}")
        if self.tp_rendezvous is None:
            if self.tp_ranks_per_node is not None:
                raise ValueError("--tp-ranks-per-node needs --tp-rendezvous (without it "
                                 "rank 0 starts every rank on this machine)")
            return
        parse_rendezvous(self.tp_rendezvous, "--tp-rendezvous")
        tp, per_node = self.tensor_parallel_size, self.ranks_per_node
        if tp == 1:
            raise ValueError("--tp-rendezvous needs --tensor-parallel-size > 1 (got 1)")
        if per_node < 1 or tp % per_node:
            raise ValueError(f"--tp-ranks-per-node {per_node} must be >= 1 and divide "
                             f"--tensor-parallel-size {tp}")

    @property
    def ranks_per_node(self) -> int:
        """Ranks that run on rank 0's machine (rank 0 starts those beside itself)."""
        if self.tp_rendezvous is None:
            return self.tensor_parallel_size
        return self.tp_ranks_per_node if self.tp_ranks_per_node is not None else 1


def parse_rendezvous(text: str, flag: str) -> tuple[str, int]:
    """(host, port) of a HOST:PORT rendezvous; a ValueError naming ``flag`` otherwise."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")  # [::1]:29500
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} must be HOST:PORT with a port in [1, 65535], got {text!r}")
    return host, int(port)


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine (one model replica with its KV cache and step loop), one group
    per concern, read as ``config.cache.block_size``. ``from_flat`` builds one from the
    flags' flat names (block_size=16, quantization="int8"): the CLI and tests use it."""

    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    compilation: CompileConfig = field(default_factory=CompileConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    FLAG_ORDER: ClassVar[tuple[str, ...]] = (
        "model", "dtype", "device", "block_size", "num_kv_blocks", "kv_cache_memory_gib",
        "kv_cache_dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
        "enable_chunked_prefill", "enable_prefix_caching", "attention_backend", "swap_space",
        "preemption_mode", "priority_batch_cap", "interrupt_steps", "hash_seed",
        "kv_offload_cpu_gib", "kv_offload_dir", "kv_offload_disk_gib", "kv_policy",
        "allow_request_kv_policy", "max_stream_len", "num_threads", "prepack_weights",
        "quantization", "quant_group_size", "quant_packed_max_rows", "compile",
        "compile_max_batch", "compile_graph_max_batch", "compile_graph_layers",
        "speculative_method", "speculative_model",
        "num_speculative_tokens", "speculative_max_batch", "enable_lora", "lora_modules",
        "max_loras", "max_lora_rank", "max_cpu_loras", "tensor_parallel_size",
        "tp_rendezvous", "tp_ranks_per_node", "tp_join_timeout_s", "enable_expert_parallel",
        "activation_quant")
    """Every group's fields in the order --help lists their flags: that of the flat config
    the groups replaced, so the help users know reads unchanged."""

    @classmethod
    def groups(cls) -> dict[str, type]:
        """Group name -> its dataclass."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in fields(cls)}

    @classmethod
    def flat_fields(cls) -> list[tuple[type, Field]]:
        """(group dataclass, field) for every field of every group, in FLAG_ORDER."""
        found = {f.name: (group, f) for group in cls.groups().values() for f in fields(group)}
        if sorted(found) != sorted(cls.FLAG_ORDER):
            raise TypeError(f"EngineConfig.FLAG_ORDER must list each group field once: "
                            f"{sorted(set(found) ^ set(cls.FLAG_ORDER))}")
        return [found[name] for name in cls.FLAG_ORDER]

    @classmethod
    def from_flat(cls, **values: Any) -> EngineConfig:
        """The config with these fields (any group's, by their flat names) set and the
        rest at their defaults. A name of no group raises TypeError, as a constructor would."""
        built = {}
        for name, group in cls.groups().items():
            own = {f.name for f in fields(group)}
            built[name] = group(**{k: values.pop(k) for k in list(values) if k in own})
        if values:
            raise TypeError(f"EngineConfig has no field {', '.join(sorted(values))}")
        return cls(**built)

    def __post_init__(self) -> None:
        mode, swap = self.scheduler.preemption_mode, self.cache.swap_space
        if swap < 0 or (swap == 0 and mode != PreemptionMode.RECOMPUTE.value):
            raise ValueError(f"--swap-space must be > 0 with --preemption-mode "
                             f"{mode} (got {swap}); use "
                             "--preemption-mode recompute to run without a swap pool")
        self._check_kv_cache_dtype()
        spec, window = self.spec, self.load.max_model_len
        if (spec.speculative_method != "none" and window is not None
                and spec.num_speculative_tokens >= window):
            raise ValueError(f"--num-speculative-tokens {spec.num_speculative_tokens} is beyond "
                             f"the context window (--max-model-len {window})")

    def _check_kv_cache_dtype(self) -> None:
        name = self.cache.kv_cache_dtype
        if name == "fp8_e4m3" and not self.load.device.startswith("cuda"):
            raise ValueError("--kv-cache-dtype fp8_e4m3 needs a CUDA device (--device cuda): "
                             "on CPU no attention path reads fp8 in place (the decode kernel "
                             "reads int8), so every step would dequantize a copy of every "
                             "context; use --kv-cache-dtype int8 (the same bytes per block) "
                             "or auto")
        compute = dtype_name(self.load.torch_dtype)
        if name in ("bfloat16", "float32") and name != compute:
            raise ValueError(f"--kv-cache-dtype {name} needs --dtype {name} (the compute dtype "
                             f"is {compute}; an unquantized cache is stored in it); use "
                             f"--kv-cache-dtype auto, int8, or --dtype {name}")

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """The KV dtype in force: the compute dtype's name under auto."""
        if self.cache.kv_cache_dtype == "auto":
            return dtype_name(self.load.torch_dtype)
        return self.cache.kv_cache_dtype

    @property
    def kv_quant(self) -> str | None:
        """The quantized KV dtype (int8, fp8_e4m3), or None for a cache in the compute dtype."""
        name = self.resolved_kv_cache_dtype
        return name if is_quantized(name) else None
