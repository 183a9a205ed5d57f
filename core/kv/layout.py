"""The paged KV cache's arithmetic, in one place: how many blocks hold a number of
tokens, how many bytes one block takes, and how a quantized block stores its scales.
Torch-free (the router sizes requests in blocks; the KV transfer layer checks block
sizes and formats).

A block is ``[L, 2 (K and V), B, Hkv, row]``. Unquantized, a row is one token's
``head_dim`` values of one KV head in the compute dtype. Quantized (``int8``,
``fp8_e4m3``), a row is ``head_dim`` one-byte codes followed by that row's bfloat16
scale (2 bytes): ``value = code * scale``, the scale computed on write from the row's
absolute maximum. Scales are per token and per KV head and live inside the block, so a
block is self-contained: transfer, swap, prefix caching and eviction move its bytes
as they are.
"""
from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8_e4m3")
"""The choices of --kv-cache-dtype (auto: the compute dtype, unquantized)."""

QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")

SCALE_BYTES = 2
"""One bfloat16 scale per quantized row."""

SCALE_LAYOUT = "per_token_head:bfloat16@row_end;block_hadamard"
"""The compatibility record's name for where quantized rows keep their scales, and the
rotation their values are stored in (engine/kv_cache/quant.py)."""

NO_SCALES = "none"


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens (the last one possibly partly filled)."""
    return -(-num_tokens // block_size)


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   itemsize: int, scale_bytes: int = 0) -> int:
    """Bytes of one block of the block-major KV tensor [L, 2 (K and V), B, Hkv, row]: a
    row is head_dim values of itemsize bytes, then scale_bytes of scale (quantized)."""
    return num_layers * 2 * block_size * num_kv_heads * (head_dim * itemsize + scale_bytes)


def is_quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in QUANTIZED_KV_DTYPES


def scale_layout(kv_cache_dtype: str) -> str:
    """SCALE_LAYOUT for a quantized KV dtype, NO_SCALES otherwise."""
    return SCALE_LAYOUT if is_quantized(kv_cache_dtype) else NO_SCALES


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8_e4m3": 1}


def kv_itemsize(kv_cache_dtype: str) -> int:
    """Bytes per stored value (a code, for a quantized dtype)."""
    return _ITEMSIZE[kv_cache_dtype]


def kv_format_block_bytes(kv_cache_dtype: str, num_layers: int, block_size: int,
                          num_kv_heads: int, head_dim: int) -> int:
    """kv_block_bytes for a resolved --kv-cache-dtype (scales included)."""
    scales = SCALE_BYTES if is_quantized(kv_cache_dtype) else 0
    return kv_block_bytes(num_layers, block_size, num_kv_heads, head_dim,
                          kv_itemsize(kv_cache_dtype), scales)
