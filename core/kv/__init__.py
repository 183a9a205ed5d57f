"""KV block arithmetic both sides agree on: chained block hashes (the prefix cache's
keys, computed alike by the router and every worker) and the bytes of a block in
each KV format (the transfer's compatibility record, the pool's size)."""
from __future__ import annotations

from core.kv.block_hash import (MAX_SALT_BYTES, BlockHash, check_salt, hash_block,
                                hash_token_blocks, lora_salt, root_hash)
from core.kv.layout import (KV_CACHE_DTYPES, blocks_for, is_quantized, kv_block_bytes,
                            kv_format_block_bytes, scale_layout)

__all__ = ["KV_CACHE_DTYPES", "MAX_SALT_BYTES", "BlockHash", "blocks_for", "check_salt",
           "hash_block", "hash_token_blocks", "is_quantized", "kv_block_bytes",
           "kv_format_block_bytes", "lora_salt", "root_hash", "scale_layout"]
