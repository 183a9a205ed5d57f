"""Configuration: the model's shape (read from the checkpoint) and the engine's knobs.

Both are frozen dataclasses validated in ``__post_init__``; a bad value raises
ValueError naming the field, so a user sees which flag to fix.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine.attention.base import ATTENTION_BACKENDS
from core.kv.layout import KV_CACHE_DTYPES, is_quantized


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family hyperparameters, as stored in a GGUF header or config.json."""

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
    """HF-style rope_scaling dict (``rope_type`` linear | llama3), or None."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"
    architecture: str = "llama"
    """The model family, a key of engine.models.MODELS."""

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, f) < 1:
                raise ValueError(f"model config: {f} must be >= 1, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def fingerprint(self) -> str:
        """Stable short hash of the architecture (the weights add their own digest)."""
        blob = json.dumps(asdict(self), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has AMX or AVX512-BF16 (bf16 matmuls beat fp32 there), as the
    capability ceiling lets Tandem see it (engine/native.py)."""
    from engine.native import cpu_flags

    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """``auto`` is bf16 on CUDA and on CPUs with AMX/avx512_bf16, fp32 elsewhere."""
    if name == "auto":
        if device.startswith("cuda") or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {name!r}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine (one model replica with its KV cache and step loop)."""

    model: str = ""
    """Path to a .gguf file or an HF directory (config.json + *.safetensors); empty = default model."""
    dtype: str = "auto"
    """Compute dtype (and the KV dtype under --kv-cache-dtype auto): auto (bf16 where the
    hardware has fast bf16), float32, bfloat16."""
    device: str = "cpu"
    """torch device: cpu or cuda[:N]."""
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
    max_model_len: int | None = None
    """Context window (prompt + output); None = the model's own, capped at 8192."""
    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 512
    """Per-step token budget (prefill chunks + decode tokens)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    enable_prefix_caching: bool = True
    """Reuse cached full blocks with equal chained hashes (and equal tokens)."""
    attention_backend: str = "auto"
    """auto (flash_attn where CUDA and the package are, else sdpa), or a name of the
    attention-backend registry: sdpa, flash_attn, naive."""
    swap_space: float = 1.0
    """Host (CPU) swap pool for preempted requests' KV blocks, GiB; pinned memory on CUDA."""
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
    hash_seed: int = 0
    """Seed of the chained block hashes; every process of one cluster must agree."""
    num_threads: int | None = None
    """torch intra-op threads; None: one per core this process may run on, capped at
    the container's CPU limit (cgroup cpu.max, rounded up)."""
    quantization: str = "auto"
    """Linear weights: auto (a GGUF's Q4_0/Q4_1/Q8_0 tensors stay packed, an HF checkpoint
    runs as stored), none (dequantize at load), int8 | int4 (quantize every linear at load),
    gguf (as auto, GGUF only). Packed weights run through fused weight-only kernels at
    small batch and keep a dense copy for large ones."""
    quant_group_size: int = 32
    """Weights per scale/zero group of --quantization int4 (32, 64, 128 or 256)."""
    quant_packed_max_rows: int | None = None
    """Steps of at most this many tokens use the packed int kernels, larger ones the dense
    weights; None = measured at start-up per weight shape (0 = always dense)."""
    compile: bool = os.environ.get("TANDEM_COMPILE", "1") != "0"
    """Compile the decode step at start-up (torch.compile per bucketed batch size 1, 2, 4,
    ... up to --compile-max-batch; CUDA graphs on GPU); --no-compile runs every step eagerly.
    TANDEM_COMPILE=0 in the environment makes --no-compile the default (the test suite's)."""
    compile_max_batch: int | None = None
    """Largest compiled decode batch (bigger decode batches run eagerly); None = max_num_seqs."""
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
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--kv-blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"--kv-cache-memory-gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.priority_batch_cap < 0:
            raise ValueError(f"--priority-batch-cap must be >= 0, got {self.priority_batch_cap}")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"--preemption-mode must be swap, recompute or auto; "
                             f"got {self.preemption_mode!r}")
        if self.swap_space < 0 or (self.swap_space == 0 and self.preemption_mode != "recompute"):
            raise ValueError(f"--swap-space must be > 0 with --preemption-mode "
                             f"{self.preemption_mode} (got {self.swap_space}); use "
                             "--preemption-mode recompute to run without a swap pool")
        ATTENTION_BACKENDS.check(self.attention_backend, extra=("auto",))
        resolve_dtype(self.dtype, self.device)
        self._check_kv_cache_dtype()
        from engine.quant.base import METHODS  # torch-only module; keeps config import light
        if self.quantization not in METHODS:
            raise ValueError(f"--quantization must be one of {', '.join(METHODS)}; "
                             f"got {self.quantization!r}")
        if self.compile_max_batch is not None and self.compile_max_batch < 1:
            raise ValueError(f"--compile-max-batch must be >= 1, got {self.compile_max_batch}")
        if self.quant_group_size not in (32, 64, 128, 256):
            raise ValueError(f"--quant-group-size must be 32, 64, 128 or 256, "
                             f"got {self.quant_group_size}")
        if self.quant_packed_max_rows is not None and self.quant_packed_max_rows < 0:
            raise ValueError(f"--quant-packed-max-rows must be >= 0, got {self.quant_packed_max_rows}")
        self._check_speculative()

    def _check_speculative(self) -> None:
        from engine.spec.registry import PROPOSERS  # torch-free
        PROPOSERS.check(self.speculative_method, extra=("none",))
        if self.speculative_method == "none":
            return
        if self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1 with "
                             f"--speculative-method {self.speculative_method}, "
                             f"got {self.num_speculative_tokens}")
        if self.max_model_len is not None and self.num_speculative_tokens >= self.max_model_len:
            raise ValueError(f"--num-speculative-tokens {self.num_speculative_tokens} is beyond "
                             f"the context window (--max-model-len {self.max_model_len})")
        if self.speculative_max_batch < 0:
            raise ValueError(f"--speculative-max-batch must be >= 0, "
                             f"got {self.speculative_max_batch}")
        if (self.speculative_method == "draft") != bool(self.speculative_model):
            raise ValueError("--speculative-model is required by --speculative-method draft "
                             "and only used by it")

    def _check_kv_cache_dtype(self) -> None:
        name = self.kv_cache_dtype
        if name not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                             f"got {name!r}")
        if name == "fp8_e4m3" and not self.device.startswith("cuda"):
            raise ValueError("--kv-cache-dtype fp8_e4m3 needs a CUDA device (--device cuda): "
                             "on CPU no attention path reads fp8 in place (the decode kernel "
                             "reads int8), so every step would dequantize a copy of every "
                             "context; use --kv-cache-dtype int8 (the same bytes per block) "
                             "or auto")
        compute = dtype_name(self.torch_dtype)
        if name in ("bfloat16", "float32") and name != compute:
            raise ValueError(f"--kv-cache-dtype {name} needs --dtype {name} (the compute dtype "
                             f"is {compute}; an unquantized cache is stored in it); use "
                             f"--kv-cache-dtype auto, int8, or --dtype {name}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.device)

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """The KV dtype in force: the compute dtype's name under auto."""
        if self.kv_cache_dtype == "auto":
            return dtype_name(self.torch_dtype)
        return self.kv_cache_dtype

    @property
    def kv_quant(self) -> str | None:
        """The quantized KV dtype (int8, fp8_e4m3), or None for a cache in the compute dtype."""
        name = self.resolved_kv_cache_dtype
        return name if is_quantized(name) else None
