"""Paged KV cache bookkeeping: block pool, chained block hashes, per-request tables."""
from __future__ import annotations

from engine.kv_cache.block_hash import (MAX_SALT_BYTES, BlockHash, check_salt, hash_block,
                                        hash_token_blocks, root_hash)
from engine.kv_cache.block_pool import BlockPool, KVEvent, KVEventKind
from engine.kv_cache.layout import (KV_CACHE_DTYPES, blocks_for, is_quantized, kv_block_bytes,
                                     kv_format_block_bytes, scale_layout)
from engine.kv_cache.manager import KVCacheManager

__all__ = ["KV_CACHE_DTYPES", "MAX_SALT_BYTES", "BlockHash", "BlockPool", "KVCacheManager", "KVEvent", "KVEventKind",
           "blocks_for", "check_salt", "hash_block", "hash_token_blocks", "is_quantized", "kv_block_bytes",
           "kv_format_block_bytes", "root_hash", "scale_layout"]
