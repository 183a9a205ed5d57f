"""Chained, typed, seeded block hashes for automatic prefix caching.

hash(block i) = sha256(hash(block i-1) || tokens of block i || extra keys), over
full blocks only, starting from a root derived from the cluster's hash seed and the
request's cache salt. It uses no Python ``hash()`` (randomised per process), so the
router and every worker compute the same hashes for the same tokens.

The cache salt (the tenant's, docs/security.md "Tenants and the prefix cache") goes
into the root, not into ``extra``: every block's hash chains from the root, so no
block of a salted prompt can equal a block of an unsalted one or of another salt's
(as sha256 does not collide), at no cost per block; ``extra`` stays for keys that
differ per block. An empty salt gives the unsalted root, byte for byte the hashes
Tandem always computed (an open router's shared cache).
"""
from __future__ import annotations

import hashlib
import struct
from typing import NewType, Sequence

from core.errors import FieldError

BlockHash = NewType("BlockHash", bytes)
MAX_SALT_BYTES = 64
"""Longest cache salt a worker takes (the router sends a 32-byte digest)."""


def root_hash(seed: int, salt: bytes = b"") -> BlockHash:
    """The chain's root. A seed's text is digits, so the NUL-tagged salt cannot be
    mistaken for another seed."""
    h = hashlib.sha256(b"tandem-kv-root:" + str(seed).encode())
    if salt:
        h.update(b"\x00salt:" + salt)
    return BlockHash(h.digest())


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    if extra:
        h.update(b"\x00extra:" + extra)
    return BlockHash(h.digest())


def hash_token_blocks(tokens: Sequence[int], block_size: int, seed: int,
                      extra: bytes = b"", prior: Sequence[BlockHash] = (),
                      salt: bytes = b"") -> list[BlockHash]:
    """Hashes of every full block of ``tokens`` under ``salt``; ``prior`` (hashes already
    computed for the leading blocks, under the same salt) is extended rather than
    recomputed."""
    out = list(prior)
    parent = out[-1] if out else root_hash(seed, salt)
    for start in range(len(out) * block_size, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start:start + block_size], extra)
        out.append(parent)
    return out


def lora_salt(salt: bytes, identity: bytes) -> bytes:
    """The salt of a request under a LoRA adapter (``identity``: a digest of its files):
    its KV differs from the base model's and every other adapter's for the same tokens, so
    its blocks chain from a root of their own (a 32-byte digest, whatever ``salt`` was)."""
    h = hashlib.sha256(b"tandem-lora-salt/v1\x00")
    h.update(len(identity).to_bytes(4, "big") + identity + salt)
    return h.digest()


def check_salt(salt: bytes) -> bytes:
    """FieldError naming cache_salt unless a worker can take it (its value is never
    put in the message: it identifies a tenant's cache)."""
    if not isinstance(salt, bytes) or len(salt) > MAX_SALT_BYTES:
        got = len(salt) if isinstance(salt, bytes) else type(salt).__name__
        raise FieldError("cache_salt", f"cache_salt: at most {MAX_SALT_BYTES} bytes, got {got}")
    return salt
