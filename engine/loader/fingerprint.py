"""Model fingerprints that identify the weights: a blake2b digest of every byte of
the checkpoint's files, plus the architecture. Two fine-tunes of one architecture,
or two files of equal size, get different fingerprints, so their workers refuse to
exchange KV (the fingerprint is part of the KV compatibility record).

Hashing reads the whole checkpoint once (about 1 GB/s here; the embedded 98 MB
model in ~0.1 s, docs/security.md); the digest is cached by path, size and mtime in
$TANDEM_CACHE/fingerprints.json, so restarts do not pay it again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

from core.cache_home import cache_home

log = logging.getLogger(__name__)
CHUNK = 8 << 20


def _cache_path() -> Path:
    return cache_home() / "fingerprints.json"


def file_digest(path: Path) -> str:
    """blake2b of the file's bytes, from the cache when path, size and mtime match."""
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    cache = _cache_path()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    t0 = time.perf_counter()
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    log.info("hashed %s (%.0f MB) in %.2fs", path.name, st.st_size / 1e6,
             time.perf_counter() - t0)
    # entries of files gone (a test's checkpoint, a replaced model) are dropped, so the
    # file holds what is on disk now: it was 3,497 entries for 225 files after a week
    known = {k: v for k, v in known.items() if Path(k.rsplit(":", 2)[0]).exists()}
    known[key] = digest
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache)
    except OSError as e:  # a read-only cache costs a re-hash next start, nothing else
        log.warning("cannot cache the model fingerprint in %s: %s", cache, e)
    return digest


def weights_fingerprint(arch_fingerprint: str, files: Sequence[Path]) -> str:
    """The architecture's fingerprint and the digest of every file, in order."""
    h = hashlib.sha256(arch_fingerprint.encode())
    for f in files:
        h.update(f.name.encode() + b"\0" + file_digest(f).encode())
    return h.hexdigest()[:32]
