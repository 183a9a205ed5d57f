"""Every attention backend against the naive reference over the paged cache."""
from __future__ import annotations

import random

import pytest
import torch

from engine.attention.base import get_backend
from engine.attention.metadata import build_metadata
from engine.attention.naive import NaiveBackend
from engine.attention.base import LayerAttention


def _case(rng: random.Random, block_size: int, hq: int, hkv: int, dtype=torch.float32):
    """A random mixed batch: prefills (some over a cached prefix) then decodes."""
    layers, d = 2, 16
    specs = []  # (cached, new)
    for _ in range(rng.randint(1, 3)):
        specs.append((rng.choice([0, 0, rng.randint(1, 40)]), rng.randint(2, 37)))
    for _ in range(rng.randint(0, 4)):
        specs.append((rng.randint(1, 60), 1))
    nblocks = sum(-(-(c + n) // block_size) for c, n in specs) + 3
    kv = torch.randn(nblocks, layers, 2, block_size, hkv, d, dtype=dtype)
    free = list(range(nblocks))
    rng.shuffle(free)
    tables = []
    for c, n in specs:
        need = -(-(c + n) // block_size)
        tables.append([free.pop() for _ in range(need)])
    qlens = [n for _, n in specs]
    slens = [c + n for c, n in specs]
    nprefill = sum(1 for n in qlens if n > 1)
    meta = build_metadata(qlens, slens, nprefill, tables, block_size)
    t = sum(qlens)
    q = torch.randn(t, hq, d, dtype=dtype)
    k = torch.randn(t, hkv, d, dtype=dtype)
    v = torch.randn(t, hkv, d, dtype=dtype)
    return layers, q, k, v, kv, meta, tables


@pytest.mark.parametrize("prefill", ["kernel", "gathered"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (9, 3), (8, 1)])
def test_sdpa_matches_naive(block_size: int, hq: int, hkv: int, prefill: str,
                            monkeypatch) -> None:
    """Prefills through the in-place kernel (engine/attention/paged_prefill.py) and
    through the gathered SDPA path it falls back to."""
    import engine.attention.paged_prefill as paged_prefill
    monkeypatch.setattr(paged_prefill, "ENABLED", prefill == "kernel")
    rng = random.Random(block_size * 100 + hq * 10 + hkv)
    sdpa, naive = get_backend("sdpa"), NaiveBackend()
    for _ in range(3):
        layers, q, k, v, kv, meta, _ = _case(rng, block_size, hq, hkv)
        for layer in range(layers):
            kv_a, kv_b = kv.clone(), kv.clone()
            meta_b = build_metadata(meta.query_lens, meta.seq_lens, meta.num_prefills,
                                    meta.block_tables, block_size)
            out_ref = naive.forward(layer, q, k, v, kv_a, meta, LayerAttention(0.25))
            out = sdpa.forward(layer, q, k, v, kv_b, meta_b, LayerAttention(0.25))
            torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(kv_b, kv_a, atol=0, rtol=0)  # same K/V writes


def test_write_kv_touches_only_its_slots() -> None:
    rng = random.Random(7)
    layers, q, k, v, kv, meta, tables = _case(rng, 16, 4, 2)
    before = kv.clone()
    get_backend("sdpa").forward(0, q, k, v, kv, meta, LayerAttention(0.25))
    changed = (kv != before).any(dim=(1, 2, 4, 5)).nonzero().tolist()  # (block, row) pairs
    expect = {(int(b), int(o)) for b, o in zip(meta.slot_blocks, meta.slot_offsets)}
    assert {(b, o) for b, o in changed} <= expect
    assert not (kv[:, 1] != before[:, 1]).any(), "layer 1 must be untouched by layer 0"


def test_bf16_close_to_reference() -> None:
    rng = random.Random(3)
    layers, q, k, v, kv, meta, _ = _case(rng, 16, 9, 3, dtype=torch.bfloat16)
    ref = NaiveBackend().forward(0, q, k, v, kv.clone(), meta, LayerAttention(0.125))
    out = get_backend("sdpa").forward(0, q, k, v, kv.clone(), meta, LayerAttention(0.125))
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_unknown_backend_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--attention-backend"):
        get_backend("nope")


def test_flash_attn_refuses_cpu_loudly() -> None:
    with pytest.raises(RuntimeError, match="--attention-backend flash_attn cannot run here"):
        get_backend("flash_attn", "cpu")
    assert get_backend("auto", "cpu").name == "sdpa"


@pytest.mark.gpu
def test_flash_attn_matches_naive_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flash_attn")
    rng = random.Random(11)
    fa, naive = get_backend("flash_attn", "cuda"), NaiveBackend()
    for block_size in (16, 256):
        layers, q, k, v, kv, meta, _ = _case(rng, block_size, 8, 2, dtype=torch.bfloat16)
        ref = naive.forward(0, q, k, v, kv.clone(), meta, LayerAttention(0.25))
        cu = build_metadata(meta.query_lens, meta.seq_lens, meta.num_prefills,
                            meta.block_tables, block_size, "cuda")
        out = fa.forward(0, q.cuda(), k.cuda(), v.cuda(), kv.clone().cuda(), cu,
                         LayerAttention(0.25))
        torch.testing.assert_close(out.float().cpu(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_sdpa_on_cuda_matches_naive() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = random.Random(12)
    layers, q, k, v, kv, meta, _ = _case(rng, 16, 8, 2, dtype=torch.bfloat16)
    ref = NaiveBackend().forward(0, q, k, v, kv.clone(), meta, LayerAttention(0.25))
    cu = build_metadata(meta.query_lens, meta.seq_lens, meta.num_prefills, meta.block_tables,
                        16, "cuda")
    out = get_backend("sdpa", "cuda").forward(0, q.cuda(), k.cuda(), v.cuda(),
                                               kv.clone().cuda(), cu, LayerAttention(0.25))
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["kernel", "fallback"])
def test_paged_decode_matches_naive(dtype: torch.dtype, impl: str) -> None:
    """The decode-only path (block tables read in place) against the reference, GQA
    groups of 1, 3 and 8, contexts from 1 token to several blocks."""
    from engine.attention import paged_decode as pd

    if impl == "kernel" and pd.kernel_unavailable() is not None:
        pytest.skip(f"paged decode kernel: {pd.kernel_unavailable()}")
    fn = pd.paged_decode if impl == "kernel" else pd.gathered_decode
    rng = random.Random(5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for block_size, hq, hkv in ((16, 9, 3), (1, 4, 4), (32, 8, 1)):
        lens = [rng.randint(1, 70) for _ in range(5)]
        nblocks = sum(-(-n // block_size) for n in lens) + 2
        kv = torch.randn(nblocks, 2, 2, block_size, hkv, 16, dtype=dtype)
        free = list(range(nblocks))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
        meta = build_metadata([1] * len(lens), lens, 0, tables, block_size)
        q = torch.randn(len(lens), hq, 16, dtype=dtype)
        k, v = torch.randn(len(lens), hkv, 16, dtype=dtype), torch.randn(len(lens), hkv, 16, dtype=dtype)
        ref = NaiveBackend().forward(1, q, k, v, kv, meta, LayerAttention(0.25))
        # (forward writes the new K/V too)
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        out = fn(q, kv, 1, bt, torch.tensor(lens), 0.25)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_write_equals_the_backend_and_padding_rows_touch_nothing(dtype) -> None:
    """A one-graph decode step's attention (``decode_write``: ``tandem::paged_decode_write``
    on ``DecodeSlots``) against the sdpa backend's decode rows: the same outputs and the
    same cache, bit for bit, for real rows with sliding windows, soft-caps and GQA; a
    bucket's padding rows (block -1, length 0) write nothing and come out zero; a slot
    outside the cache is refused, naming it."""
    from engine.attention import paged_decode as pd
    from engine.attention.metadata import decode_slots

    if pd.kernel_unavailable() is not None:
        pytest.skip(f"paged decode kernel: {pd.kernel_unavailable()}")
    rng = random.Random(11)
    block_size, hq, hkv, d, layers = 16, 9, 3, 16, 3
    lens = [1, 17, 40]
    nblocks = sum(-(-n // block_size) for n in lens) + 4
    kv = torch.randn(nblocks, layers, 2, block_size, hkv, d, dtype=dtype)
    free = list(range(nblocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    meta = build_metadata([1] * 3, lens, 0, tables, block_size)
    slots = decode_slots(meta, 4, 5)  # one padding row; tables padded to 5 blocks
    assert slots.blocks.tolist()[3] == -1 and slots.lens.tolist()[3] == 0
    assert decode_slots(meta, 4, 2) is None  # a 3-block table is wider: the per-layer path
    q = torch.randn(4, hq, d, dtype=dtype)
    k, v = torch.randn(4, hkv, d, dtype=dtype), torch.randn(4, hkv, d, dtype=dtype)
    for params in (LayerAttention(0.25), LayerAttention(0.25, window=20, softcap=5.0)):
        for layer in range(layers):
            want_kv, got_kv = kv.clone(), kv.clone()
            want = get_backend("sdpa").forward(layer, q[:3], k[:3], v[:3], want_kv, meta,
                                               params)
            got = pd.decode_write(layer, q, k, v, got_kv, slots, params)
            assert torch.equal(got[:3], want) and not got[3].any()
            assert torch.equal(got_kv, want_kv)
    bad = decode_slots(build_metadata([1], [1], 0, [[nblocks]], block_size), 1, 5)
    with pytest.raises(RuntimeError, match="row 0's slot is outside the cache"):
        pd.decode_write(0, q[:1], k[:1], v[:1], kv, bad, LayerAttention(0.25))


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("d", [64, 40])  # 40: rows that end mid-vector
def test_paged_decode_kernel_long_contexts(kind: str, d: int) -> None:
    """The kernel against the gathered path where it splits a context into ranges run
    as separate tasks and merged (few sequences, hundreds of tokens), lengths differing
    per row (one shorter than a tile, so some ranges are empty), GQA group 3."""
    from engine.attention import paged_decode as pd
    from engine.kv_cache.quant import encode

    if pd.kernel_unavailable() is not None:
        pytest.skip(f"paged decode kernel: {pd.kernel_unavailable()}")
    rng = random.Random(11)
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    tol = 2e-2 if kind == "bfloat16" else 1e-5
    for lens in ([1000], [5, 333, 1290]):
        nblocks = sum(-(-n // 16) for n in lens) + 2
        x = torch.randn(nblocks, 2, 2, 16, 3, d)
        kv = encode(x, "int8") if kind == "int8" else x.to(dtype)
        free = list(range(nblocks))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(-(-n // 16))] for n in lens]
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        q = torch.randn(len(lens), 9, d, dtype=dtype)
        quant = "int8" if kind == "int8" else None
        out = pd.kernel_decode(q, kv, 1, bt, torch.tensor(lens), 0.125, quant)
        ref = pd.gathered_decode(q, kv, 1, bt, torch.tensor(lens), 0.125, quant)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_paged_decode_bf16_dot_products_match_the_fp32_path(d: int) -> None:
    """bf16 decode attention on its bf16 dot-product scores (AVX512_BF16 CPUs; elsewhere
    both runs take the fp32 path) against the kernel's widened fp32 path (fma_only):
    the same output to within one bf16 rounding and the same scores an h2o row leaves,
    over ragged contexts (one shorter than a tile, several split into ranges), GQA
    groups of 3, 8 and 1, with and without a window and soft-cap."""
    from engine.attention import paged_decode as pd

    if pd.kernel_unavailable() is not None:
        pytest.skip(f"paged decode kernel: {pd.kernel_unavailable()}")
    rng = random.Random(d)
    for (hq, hkv), window, softcap in (((9, 3), 0, 0.0), ((8, 1), 40, 0.0),
                                        ((4, 4), 0, 5.0)):
        lens = [5, 16, 17, 150, 700, 33]
        nblocks = sum(-(-n // 16) for n in lens) + 2
        kv = torch.randn(nblocks, 2, 2, 16, hkv, d, dtype=torch.bfloat16)
        free = list(range(nblocks))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(-(-n // 16))] for n in lens]
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        q = torch.randn(len(lens), hq, d, dtype=torch.bfloat16)
        rows = torch.tensor([0, -1, 1, -1, 2, 3])
        outs, scores = [], []
        for fma_only in (False, True):
            logits = torch.full((4, hq, max(lens)), float("-inf"))
            outs.append(torch.ops.tandem.paged_decode(
                q, kv, 1, bt, torch.tensor(lens), d ** -0.5, window, softcap, rows, logits,
                fma_only=fma_only).float())
            scores.append(logits)
        torch.testing.assert_close(outs[0], outs[1], atol=2e-3, rtol=2 ** -7)
        torch.testing.assert_close(scores[0], scores[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 3.0), (8, 2.0)])
def test_naive_window_and_softcap_follow_their_definitions(window, softcap) -> None:
    """One sequence whose whole context is new: the reference against the formula written
    out on dense tensors (a key at distance >= window is hidden; logits soft-capped)."""
    torch.manual_seed(3)
    n, h, d = 13, 2, 8
    q, k, v = (torch.randn(n, h, d) for _ in range(3))
    meta = build_metadata([n], [n], 1, [[0]], 16)
    kv = torch.zeros(1, 1, 2, 16, h, d)
    params = LayerAttention(0.3, window=window, softcap=softcap)
    out = NaiveBackend().forward(0, q, k, v, kv, meta, params)
    s = torch.einsum("qhd,khd->hqk", q, k) * 0.3
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(n)
    dist = pos[:, None] - pos[None, :]
    hidden = (dist < 0) | (dist >= (window or n + 1))
    want = torch.einsum("hqk,khd->qhd", s.masked_fill(hidden, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(out, want)


def test_a_backend_refuses_parameters_it_does_not_compute() -> None:
    class Plain(NaiveBackend):
        name, supports = "plain", frozenset()
    Plain().check(LayerAttention(1.0))
    with pytest.raises(ValueError, match="--attention-backend plain does not compute window"):
        Plain().check(LayerAttention(1.0, window=4))


def test_the_decode_benchmark_runs() -> None:
    """bench/decode_attention.py (docs/performance.md) on a small batch."""
    import subprocess
    import sys
    from pathlib import Path

    from engine.attention import paged_decode as pd

    if pd.kernel_unavailable() is not None:
        pytest.skip(f"paged decode kernel: {pd.kernel_unavailable()}")
    script = Path(__file__).resolve().parents[2] / "bench" / "decode_attention.py"
    out = subprocess.run([sys.executable, str(script), "--rows", "2", "--ctx", "40",
                          "--layers", "2", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [ln.split(" | ")[0] for ln in lines[-3:]] == ["kernel", "kernel, fma_only",
                                                          "gather + SDPA"], out.stdout
