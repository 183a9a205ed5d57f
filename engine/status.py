"""What an engine says about itself, as plain values any thread may read: the facts
fixed when it is built (EngineInfo) and a snapshot of its load (EngineLoad)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig


@dataclass(frozen=True)
class EngineInfo:
    """What never changes after the engine is built (safe to read from any thread)."""

    model_config: ModelConfig
    fingerprint: str
    block_size: int
    num_blocks: int
    max_model_len: int
    block_bytes: int
    """Bytes of one KV block, scales included (engine/kv_cache/layout.py)."""
    kv_cache_dtype: str = ""
    """How K/V are stored (--kv-cache-dtype, resolved: bfloat16, float32, int8, fp8_e4m3)."""
    dtype: str = ""
    """The compute dtype's name."""


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot the engine thread takes after every loop iteration."""

    num_waiting: int = 0
    num_running: int = 0
    num_loading: int = 0
    """Requests holding blocks while their leading KV is written (WAITING_FOR_KV)."""
    num_kept: int = 0
    """Finished requests whose blocks a KV connector keeps (engine/kv_connector.py)."""
    free_blocks: int = 0
    total_blocks: int = 0
    queued_prompt_tokens: int = 0
    swap_used_blocks: int = 0

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def busy(self) -> bool:
        """Anything still in flight (drain waits for False)."""
        return bool(self.num_waiting or self.num_running or self.num_loading or self.num_kept)

