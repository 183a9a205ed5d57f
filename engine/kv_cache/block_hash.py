"""Chained, typed, seeded block hashes for automatic prefix caching.

hash(block i) = sha256(hash(block i-1) || tokens of block i || extra keys), over
full blocks only, starting from a root derived from the cluster's hash seed. It
uses no Python ``hash()`` (randomised per process), so the router and every
worker compute the same hashes for the same tokens.
"""
from __future__ import annotations

import hashlib
import struct
from typing import NewType, Sequence

BlockHash = NewType("BlockHash", bytes)


def root_hash(seed: int) -> BlockHash:
    return BlockHash(hashlib.sha256(b"tandem-kv-root:" + str(seed).encode()).digest())


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    if extra:
        h.update(b"\x00extra:" + extra)
    return BlockHash(h.digest())


def hash_token_blocks(tokens: Sequence[int], block_size: int, seed: int,
                      extra: bytes = b"", prior: Sequence[BlockHash] = ()) -> list[BlockHash]:
    """Hashes of every full block of ``tokens``; ``prior`` (hashes already computed
    for the leading blocks) is extended rather than recomputed."""
    out = list(prior)
    parent = out[-1] if out else root_hash(seed)
    for start in range(len(out) * block_size, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start:start + block_size], extra)
        out.append(parent)
    return out
