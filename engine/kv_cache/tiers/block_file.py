"""One KV block as a file of the disk tier: what it is, and proof that it is intact.

    MAGIC (8 bytes) | header length (u32, little-endian) | header (JSON) | payload | digest

The header names the model fingerprint (engine/loader/fingerprint.py, as served:
quantization included), the KV format (dtype, storage dtype, block-major layout, block
shape, scale layout), the block's hash and its tokens; the payload is the block's bytes
as the pool holds them; the digest is a 32-byte blake2b of everything before it. A file
is read as KV only when the digest matches and the header equals what this engine would
write; anything else is CorruptBlock (the bytes are not what was written) or
ForeignBlock (intact, but another model's or format's).
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass

from core.kv.block_hash import BlockHash

MAGIC = b"TNDMKVB1"
DIGEST_BYTES = 32


class CorruptBlock(ValueError):
    """The file is not what was written (truncated, a flipped byte, not ours at all)."""


class ForeignBlock(ValueError):
    """An intact block file of another model, KV format or block."""


@dataclass(frozen=True)
class KVFormat:
    """Everything a block's bytes depend on besides its tokens."""

    fingerprint: str
    kv_dtype: str
    storage_dtype: str
    block_shape: tuple[int, ...]
    """[L, 2 (K and V), B, Hkv, row] (core/kv/layout.py)."""
    scale_layout: str
    layout: str = "block-major[L,2,B,Hkv,row]"

    @property
    def key(self) -> str:
        """A short name of the format, in every file name: engines of different models
        can share one directory without ever opening each other's files."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}[self.storage_dtype]


def _header(fmt: KVFormat, block_hash: BlockHash, tokens: tuple[int, ...]) -> dict:
    return {"format": {**asdict(fmt), "block_shape": list(fmt.block_shape)},
            "block_hash": block_hash.hex(), "tokens": list(tokens)}


def _same_block(header: dict, want: dict) -> bool:
    """Same model, format and hash; the tokens are compared apart (a miss, not damage)."""
    return {k: v for k, v in header.items() if k != "tokens"} == \
        {k: v for k, v in want.items() if k != "tokens"}


def encode(fmt: KVFormat, block_hash: BlockHash, tokens: tuple[int, ...], payload: bytes) -> bytes:
    header = json.dumps(_header(fmt, block_hash, tokens), sort_keys=True).encode()
    body = MAGIC + struct.pack("<I", len(header)) + header + payload
    return body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()


def decode(fmt: KVFormat, block_hash: BlockHash, tokens: tuple[int, ...],
           data: bytes) -> bytes | None:
    """The payload of a file written by ``encode`` for exactly this block and format;
    None when it holds other tokens under this hash (a hash collision: a miss)."""
    body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if (len(data) < len(MAGIC) + 4 + DIGEST_BYTES or not body.startswith(MAGIC)
            or hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest):
        raise CorruptBlock("checksum mismatch")
    (n,) = struct.unpack_from("<I", body, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(body[start:start + n])
    except ValueError as e:
        raise CorruptBlock(f"unreadable header: {e}") from e
    want = _header(fmt, block_hash, tokens)
    if not isinstance(header, dict) or not _same_block(header, want):
        raise ForeignBlock("another model, KV format or block")
    if header["tokens"] != want["tokens"]:
        return None
    payload = body[start + n:]
    if len(payload) != fmt.block_bytes:
        raise CorruptBlock(f"payload {len(payload)} bytes, want {fmt.block_bytes}")
    return payload
