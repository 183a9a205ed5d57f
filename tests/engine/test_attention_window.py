"""Sliding windows and logit soft-caps in every attention path, against the naive reference
and the definition (LayerAttention): prefill chunks over a cached prefix that crosses
the window edge, plain decodes, speculative-verification rows (1 + k one-token queries
over one table), windows shorter and longer than the contexts, block sizes 1/16/32, GQA
groups 1/3/8, fp32, bf16 and int8 KV, the native decode kernel and the gathered path.

Blocks wholly before a row's window are replaced in the backend's tables by a poisoned
block (NaN K and V): a path that read one would return NaN (the KV manager frees them)."""
from __future__ import annotations

import random

import pytest
import torch

import engine.attention.paged_decode as pd
from engine.attention.base import get_backend
from engine.attention.metadata import build_metadata
from engine.attention.base import LayerAttention, first_key, gather_kv
from engine.attention.naive import NaiveBackend
from engine.kv_cache.quant import encode

D, LAYERS = 16, 2

PARAMS = [LayerAttention(0.25, window=3), LayerAttention(0.25, window=20),
          LayerAttention(0.25, window=1000), LayerAttention(0.25, softcap=4.0),
          LayerAttention(0.25, window=7, softcap=2.5), LayerAttention(0.25, window=1)]


def _rows(rng: random.Random) -> tuple[list[tuple[int, int]], list[int]]:
    """(cached, new) per row, prefills first, and each row's sequence (a speculative
    group's rows share one): decodes and one verification group of 1 + k rows."""
    rows = [(rng.choice([0, rng.randint(1, 90)]), rng.randint(2, 40))
            for _ in range(rng.randint(1, 2))]
    rows += [(rng.randint(1, 90), 1) for _ in range(rng.randint(0, 3))]
    seq = list(range(len(rows)))
    base, k = rng.randint(1, 90), rng.randint(1, 3)
    rows += [(base + j, 1) for j in range(k + 1)]
    seq += [len(seq)] * (k + 1)
    return rows, seq


def _batch(rng: random.Random, bs: int, hq: int, hkv: int, kind: str, window: int | None):
    """q, k, v, the cache (its last block the poison), full tables, poisoned tables, the
    row layout."""
    rows, seq = _rows(rng)
    ends: dict[int, int] = {}
    firsts: dict[int, int] = {}
    for (c, n), s in zip(rows, seq):
        ends[s] = max(ends.get(s, 0), c + n)
        firsts[s] = min(firsts.get(s, c + 1), first_key(c, window) // bs)
    nblocks = sum(-(-e // bs) for e in ends.values()) + 1
    free = list(range(nblocks - 1))
    rng.shuffle(free)
    own = {s: [free.pop() for _ in range(-(-e // bs))] for s, e in ends.items()}
    poisoned = {s: [nblocks - 1] * firsts[s] + t[firsts[s]:] for s, t in own.items()}
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    x = torch.randn(nblocks, LAYERS, 2, bs, hkv, D)
    x[-1] = float("nan")
    kv = encode(x, "int8") if kind == "int8" else x.to(dtype)
    t = sum(n for _, n in rows)
    q, k, v = (torch.randn(t, h, D, dtype=dtype) for h in (hq, hkv, hkv))
    return q, k, v, kv, [own[s] for s in seq], [poisoned[s] for s in seq], rows


def _definition(layer: int, q, kv, meta, quant: str | None, params: LayerAttention):
    """softmax over visible keys of cap(q.k * scale), row by row on the whole context."""
    out, start = [], 0
    rep = q.shape[1] // kv.shape[-2]
    for qlen, slen, table in zip(meta.query_lens, meta.seq_lens, meta.block_tables):
        ks, vs = (x.float() for x in gather_kv(layer, kv, table, slen, quant, torch.float32))
        s = torch.einsum("qhd,khd->hqk", q[start:start + qlen].float(),
                         ks.repeat_interleave(rep, 1)) * params.scale
        if params.softcap is not None:
            s = params.softcap * torch.tanh(s / params.softcap)
        dist = torch.arange(slen - qlen, slen)[:, None] - torch.arange(slen)[None, :]
        hidden = (dist < 0) | (dist >= (params.window or slen + 1))
        p = s.masked_fill(hidden, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", p, vs.repeat_interleave(rep, 1)))
        start += qlen
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("impl", ["kernel", "gathered"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("bs", [1, 16, 32])
def test_sdpa_window_and_softcap_match_naive(bs: int, hq: int, hkv: int, impl: str, kind: str,
                                             monkeypatch) -> None:
    if impl == "kernel" and pd.kernel_unavailable() is not None:
        pytest.skip(f"paged decode kernel: {pd.kernel_unavailable()}")
    monkeypatch.setattr(pd, "KERNEL_MAX_ROWS", 1 << 16 if impl == "kernel" else 0)
    rng = random.Random(f"{bs}-{hq}-{hkv}-{impl}-{kind}")
    quant = "int8" if kind == "int8" else None
    tol = 2e-2 if kind == "bfloat16" else 1e-5
    sdpa, naive = get_backend("sdpa"), NaiveBackend()
    for params in PARAMS:
        q, k, v, kv, full, poisoned, rows = _batch(rng, bs, hq, hkv, kind, params.window)
        qlens, slens = [n for _, n in rows], [c + n for c, n in rows]
        nprefill = sum(1 for n in qlens if n > 1)
        layer = rng.randrange(LAYERS)
        meta = build_metadata(qlens, slens, nprefill, full, bs, kv_quant=quant)
        kv_ref = kv.clone()
        ref = naive.forward(layer, q, k, v, kv_ref, meta, params)
        want = _definition(layer, q, kv_ref, meta, quant, params)
        torch.testing.assert_close(ref.float(), want, atol=tol, rtol=tol)
        out = sdpa.forward(layer, q, k, v, kv,
                           build_metadata(qlens, slens, nprefill, poisoned, bs, kv_quant=quant),
                           params)
        assert not out.isnan().any(), f"{params}: a block before the window was read"
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_a_window_of_one_sees_only_itself() -> None:
    """window=1: each query's output is its own value row (GQA: its group's)."""
    rng = random.Random(4)
    q, k, v, kv, full, _, rows = _batch(rng, 16, 6, 2, "float32", 1)
    qlens, slens = [n for _, n in rows], [c + n for c, n in rows]
    meta = build_metadata(qlens, slens, sum(1 for n in qlens if n > 1), full, 16)
    out = get_backend("sdpa").forward(0, q, k, v, kv, meta, LayerAttention(0.25, window=1))
    torch.testing.assert_close(out, v.repeat_interleave(3, 1))


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_kernel_long_windowed_contexts_split_into_ranges(kind: str) -> None:
    """The kernel splits a long context into ranges run as separate tasks: with a window,
    the ranges cover only the window (not from token 0), lengths below and above it."""
    if pd.kernel_unavailable() is not None:
        pytest.skip(f"paged decode kernel: {pd.kernel_unavailable()}")
    rng = random.Random(8)
    lens, window, bs = [1290, 700, 300, 5], 600, 16
    nblocks = sum(-(-n // bs) for n in lens) + 1
    x = torch.randn(nblocks, 2, 2, bs, 3, 64)
    x[-1] = float("nan")
    kv = encode(x, "int8") if kind == "int8" else x
    free = list(range(nblocks - 1))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    poisoned = [[nblocks - 1] * (first_key(n - 1, window) // bs) + t[first_key(n - 1, window) // bs:]
                for n, t in zip(lens, tables)]
    width = max(len(t) for t in tables)
    pad = lambda ts: torch.tensor([t + [0] * (width - len(t)) for t in ts])  # noqa: E731
    q = torch.randn(len(lens), 9, 64)
    quant = "int8" if kind == "int8" else None
    for softcap in (None, 30.0):
        out = pd.kernel_decode(q, kv, 1, pad(poisoned), torch.tensor(lens), 0.125, quant,
                               window, softcap)
        ref = pd.gathered_decode(q, kv, 1, pad(tables), torch.tensor(lens), 0.125, quant,
                                 window, softcap)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_flash_attn_declares_window_and_softcap() -> None:
    """Its window/soft-cap arguments run only on CUDA (the gpu test below); on CPU the
    backend is refused at get_backend, so declaring them here claims nothing untested."""
    from engine.attention.flash_attn import FlashAttnBackend

    assert FlashAttnBackend.supports == {"window", "softcap"}


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 256])
def test_flash_attn_window_and_softcap_match_naive(bs: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flash_attn")
    rng = random.Random(bs)
    fa, naive = get_backend("flash_attn", "cuda"), NaiveBackend()
    for params in PARAMS:
        q, k, v, kv, full, poisoned, rows = _batch(rng, bs, 8, 2, "bfloat16", params.window)
        qlens, slens = [n for _, n in rows], [c + n for c, n in rows]
        n = sum(1 for x in qlens if x > 1)
        ref = naive.forward(0, q, k, v, kv.clone(), build_metadata(qlens, slens, n, full, bs),
                            params)
        meta = build_metadata(qlens, slens, n, poisoned, bs, "cuda")
        out = fa.forward(0, q.cuda(), k.cuda(), v.cuda(), kv.cuda(), meta, params)
        torch.testing.assert_close(out.float().cpu(), ref.float(), atol=2e-2, rtol=2e-2)


def test_kernel_refuses_a_freed_block_inside_the_window() -> None:
    """A table entry the window needs that was freed (-1) or lies outside the cache is an
    error naming the row, never a read outside the cache."""
    if pd.kernel_unavailable() is not None:
        pytest.skip(f"paged decode kernel: {pd.kernel_unavailable()}")
    kv = torch.randn(4, 1, 2, 16, 2, D)
    q = torch.randn(1, 2, D)
    lens = torch.tensor([40])
    pd.kernel_decode(q, kv, 0, torch.tensor([[-1, 1, 2]]), lens, 0.25, window=20)  # 20..39
    for table in ([[-1, 1, 2]], [[0, 1, 4]]):
        with pytest.raises(RuntimeError, match="paged_decode: row 0 reads block"):
            pd.kernel_decode(q, kv, 0, torch.tensor(table), lens, 0.25, window=30)
    with pytest.raises(RuntimeError, match="row 0's table has no block 2"):
        pd.kernel_decode(q, kv, 0, torch.tensor([[0, 1]]), lens, 0.25)
