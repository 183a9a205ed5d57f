"""The paged KV cache's arithmetic, in one place: how many blocks hold a number of
tokens, and how many bytes one block takes. Torch-free (the router sizes requests
in blocks; the KV transfer layer checks block sizes)."""
from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens (the last one possibly partly filled)."""
    return -(-num_tokens // block_size)


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   itemsize: int) -> int:
    """Bytes of one block of the block-major KV tensor [L, 2 (K and V), B, Hkv, D]."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize
