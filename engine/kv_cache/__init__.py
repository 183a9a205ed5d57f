"""Paged KV cache bookkeeping: block pool, per-request tables, swap pool. Block hashes
and layout arithmetic are core's (core/kv), shared with the router."""
from __future__ import annotations

from engine.kv_cache.block_pool import BlockPool, KVEvent, KVEventKind
from engine.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager", "KVEvent", "KVEventKind"]
