"""Decode attention over the paged cache, without gathering the context first.

``paged_decode(q, kv, layer, tables, lens, scale, kv_quant)`` -> [N, Hq, D] for N
sequences with one query token each. On CPU (up to KERNEL_MAX_ROWS sequences: any
batch the engine runs) it runs ``torch.ops.tandem.paged_decode``
(csrc/paged_decode.cpp): K and V rows are read in place through the block tables, one
sequence (or, with few sequences, one range of its tokens) per task, so a step copies
no context; an int8 cache is read as codes, its row scales folded into the scores and
the softmax weights (no dequantized copy). The
extension is built on first use with the machine's compiler (about 20 s, cached in
torch's extension directory, ~/.cache/torch_extensions/tandem/, under a name that
carries the source's hash, so two versions of the source never rebuild over each other).
Builders take an flock first (the kernel drops it when a builder dies), so a process
killed mid-build cannot leave torch's own lock file behind to hang every later start.

Above KERNEL_MAX_ROWS, and elsewhere (CUDA, an fp8 cache, or no compiler: said once in
the log), it takes the gathered path: one batched SDPA over the contexts padded to the
longest, a quantized cache dequantized as it is gathered.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention.base import gather_blocks
from engine.kv_cache.quant import rotation

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_lock = threading.Lock()
_state: dict[str, str | None] = {}


def kernel_unavailable() -> str | None:
    """None when the CPU kernel is loaded (building it on first call), else why not."""
    with _lock:
        if "reason" not in _state:
            _state["reason"] = _build()
            if _state["reason"] is not None:
                log.warning("paged decode kernel unavailable (%s); decode attention gathers "
                            "the context first", _state["reason"])
        return _state["reason"]


BUILD_WAIT_S = 900.0
"""How long a process waits for another one's build before taking the gathered path."""


def _build() -> str | None:
    try:
        from torch.utils.cpp_extension import load

        build_dir = build_directory()
        name = build_dir.name
        build_dir.mkdir(parents=True, exist_ok=True)
        with build_lock(build_dir, BUILD_WAIT_S):
            load(name=name, sources=[str(_SOURCE)], is_python_module=False,
                 extra_cflags=["-O3", "-march=native", "-fopenmp", *_vec_flags()],
                 extra_ldflags=["-fopenmp"], build_directory=str(build_dir))
        torch.library.register_fake("tandem::paged_decode")(
            lambda q, kv, layer, tables, lens, scale: torch.empty_like(q))
    except Exception as e:  # no compiler, no headers: the fallback still works
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e) else ''}"
    return None


def build_directory() -> Path:
    """Where the kernel is built: torch's extension root, tandem/, a name carrying the
    source's hash."""
    from torch.utils.cpp_extension import get_default_build_root

    name = f"tandem_paged_decode_{hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / "tandem" / name


@contextlib.contextmanager
def build_lock(build_dir: Path, wait_s: float):
    """Hold the build directory's flock (waiting up to wait_s for a live builder:
    TimeoutError after). Holding it, any torch ``lock`` file there is stale, left by a
    builder that died (torch's FileBaton would wait for it forever), and is removed."""
    with open(build_dir / "tandem-build.lock", "w") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {build_dir.name} "
                                       f"for over {wait_s:.0f} s") from None
                time.sleep(0.2)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _vec_flags() -> list[str]:
    """ATen's Vectorized<float> at the widest ISA this CPU has (its exp is then inline)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for isa, need in (("AVX512", ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
                      ("AVX2", ("avx2", "fma"))):
        if all(f" {n}" in flags for n in need):
            return [f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}"]
    return []


KERNEL_MAX_ROWS = 1 << 16
"""Above this many decode rows the gathered SDPA path runs (tests lower it to force that
path). The tiled kernel wins at every batch measured: one layer, bf16, 2 threads,
kernel vs gathered ms at 160 tokens of context 0.09 vs 0.31 (8 rows), 0.47 vs 1.23
(32), 0.81 vs 1.99 (64); at 2,048 tokens 1.10 vs 2.25 (8), 5.11 vs 13.05 (32), 13.2
vs 65.0 (64). The first kernel lost from about 64 rows, hence a cap of 16 until the
tiles."""


def paged_decode(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, kv_quant: str | None = None) -> torch.Tensor:
    """q [N, Hq, D]; kv the whole cache; tables [N, maxb] long (padded with any block
    id); lens [N] long; kv_quant None (kv in q's dtype) or a quantized --kv-cache-dtype
    -> [N, Hq, D]."""
    if (kv.device.type == "cpu" and q.shape[0] <= KERNEL_MAX_ROWS
            and kv_quant in (None, "int8") and kernel_unavailable() is None):
        return kernel_decode(q, kv, layer, tables, lens, scale, kv_quant)
    return gathered_decode(q, kv, layer, tables, lens, scale, kv_quant)


def kernel_decode(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
                  lens: torch.Tensor, scale: float, kv_quant: str | None = None) -> torch.Tensor:
    """The in-place kernel. An int8 cache holds rotated rows (engine/kv_cache/quant.py):
    the kernel gets the rotated query (q . k is unchanged) and its output, a weighted sum
    of rotated values, is rotated back."""
    if kv_quant is None:
        return torch.ops.tandem.paged_decode(q.contiguous(), kv, layer, tables, lens, scale)
    r = rotation(q.shape[-1], q.device)
    qr = (q.float() @ r).to(q.dtype).contiguous()
    out = torch.ops.tandem.paged_decode(qr, kv, layer, tables, lens, scale)
    return (out.float() @ r).to(q.dtype)


def gathered_decode(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
                    lens: torch.Tensor, scale: float, kv_quant: str | None = None
                    ) -> torch.Tensor:
    """The fallback: gather each context (padded to the longest), one batched SDPA with a
    key mask (faster on CPU than an explicit matmul-softmax-matmul over the same gather)."""
    n = q.shape[0]
    ks, vs = gather_blocks(layer, kv, tables.reshape(-1), kv_quant, q.dtype)  # [N*maxb, B, Hkv, D]
    ks = ks.view(n, -1, *ks.shape[-2:]).transpose(1, 2)  # [N, Hkv, S, D]
    vs = vs.view(n, -1, *vs.shape[-2:]).transpose(1, 2)
    keys = torch.arange(ks.shape[2], device=q.device)
    mask = (keys.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]  # [N, 1, 1, S]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=mask, scale=scale,
                                         enable_gqa=True)  # [N, Hq, 1, D]
    return out.squeeze(2)
