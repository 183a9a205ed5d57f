"""KV tiers below the device pool: host memory, then disk (docs/kv-offload.md).

``build_tiers`` makes them from the engine's flags; the KV manager calls them through
two hooks (BlockPool.on_evict, KVCacheManager.lower_tiers) and the engine flushes their
copies once per step (TieredCache.flush)."""
from __future__ import annotations

import torch

from core.kv.layout import scale_layout
from engine.config import CacheConfig
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.swap import HostSlots
from engine.kv_cache.tiers.block_file import KVFormat
from engine.kv_cache.tiers.disk import DiskTier
from engine.kv_cache.tiers.tiered import CopyBlocks, HostBlocks, TieredCache, TierStats

__all__ = ["TierStats", "TieredCache", "build_tiers", "kv_format"]


def kv_format(fingerprint: str, kv_dtype: str, device_kv: torch.Tensor,
              kv_heads: int | None = None) -> KVFormat:
    """The format of a block file: a block with every KV head (``kv_heads``: the model's,
    where ``device_kv`` holds one tensor-parallel rank's share of them)."""
    shape = list(device_kv.shape[1:])
    if kv_heads is not None:
        shape[-2] = kv_heads
    return KVFormat(fingerprint, kv_dtype, str(device_kv.dtype).removeprefix("torch."),
                    tuple(shape), scale_layout(kv_dtype))


def build_tiers(cache: CacheConfig, kv: KVCacheManager, device_kv: torch.Tensor,
                slots: HostSlots, fingerprint: str,
                kv_dtype: str, copy_blocks: CopyBlocks, host_blocks: HostBlocks,
                kv_heads: int) -> TieredCache | None:
    """The tiers the flags ask for, hooked into ``kv`` (None: --kv-offload-cpu-gib 0;
    CacheConfig checked the sizes). ValueError naming --kv-offload-dir when it cannot
    be written. host_blocks: how whole blocks (every KV head, ``kv_heads`` of them) are
    read from and written to host slots (the runner's: at TP > 1 gathered from and
    scattered to the ranks)."""
    if not cache.kv_offload_cpu_gib:
        return None
    disk = None
    if cache.kv_offload_dir:
        disk = DiskTier(cache.kv_offload_dir, int(cache.kv_offload_disk_gib * (1 << 30)),
                        kv_format(fingerprint, kv_dtype, device_kv, kv_heads))
    tiers = TieredCache(slots, cache.block_size, copy_blocks, disk, host_blocks)
    tiers.attach(kv.pool)
    kv.lower_tiers = tiers
    return tiers
