"""KV memory that follows a sliding window: blocks no layer can attend to any more are
freed while a request runs, admission counts what a request really holds, prefix hits
stay exact, and swapping moves only the held blocks. A fake model over the scheduler
(each KV slot records which token wrote it) checks that every key a query can see is
present and right, step after step, with preemption by swap and by recompute."""
from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.kv_cache import KVCacheManager
from engine.kv_cache.manager import NULL_BLOCK
from engine.kv_cache.swap import SwapPool
from engine.request import Request
from engine.scheduler import Scheduler
from core.sampling import SamplingParams

WINDOW, BS = 256, 16
BOUND = WINDOW // BS + 2  # blocks a decoding request may hold


def _req(rid: str, toks: list[int], max_tokens: int = 4000, priority: int = 0) -> Request:
    return Request(rid, list(toks), SamplingParams(max_tokens=max_tokens), priority=priority)


def _held(kv: KVCacheManager, rid: str) -> int:
    return sum(1 for b in kv.table(rid) if b != NULL_BLOCK)


def test_a_4000_token_generation_holds_at_most_the_window() -> None:
    """Decoding 4,000 tokens with a 256-token window in a pool of BOUND blocks: never more
    than window/block_size + 2 blocks held; without the window the same pool runs out."""
    for window, fits in ((WINDOW, True), (None, False)):
        kv = KVCacheManager(BOUND, BS, sliding_window=window)
        r = _req("a", range(40))
        assert kv.allocate(r, 40)
        r.num_computed_tokens = 40
        r.token_ids.append(1)
        most = 0
        for step in range(4000):
            if not kv.allocate(r, 1):
                break
            most = max(most, _held(kv, "a"))
            r.num_computed_tokens += 1
            r.token_ids.append(step % 300)
            kv.cache_computed(r)
        assert (step == 3999) is fits
        if fits:
            assert most == BOUND - 1  # a query at 16m sees blocks m-16 .. m
            assert kv.table("a")[: (r.num_computed_tokens - WINDOW) // BS] == \
                [NULL_BLOCK] * ((r.num_computed_tokens - WINDOW) // BS)
        kv.free(r)
        kv.leak_check()


def test_admission_counts_only_the_window_a_chunk_needs() -> None:
    """A chunk deep into a long prompt needs the window before it and its own blocks, not
    the whole context: it is admitted into a pool far smaller than the prompt."""
    kv = KVCacheManager(30, BS, sliding_window=64)
    r = _req("a", range(2000))
    for start in range(0, 1984, 128):
        r.num_computed_tokens = start
        assert kv.allocate(r, 128), start
        assert _held(kv, "a") <= (64 + 128) // BS + 2
    kv.free(r)
    kv.leak_check()


def test_a_prefix_hit_is_exact_and_adopts_only_the_window() -> None:
    """A freed block keeps its prefix-cache entry (its K/V stay valid); a later prompt
    with that prefix hits the whole chain while it is present, takes a reference only
    on the blocks within its first query's window, and gets no hit once a block of the
    chain was evicted."""
    kv = KVCacheManager(40, BS, sliding_window=32)
    a = _req("a", range(200))
    for start in range(0, 192, 32):  # chunked prefill: early blocks freed as it goes
        a.num_computed_tokens = start
        assert kv.allocate(a, 32)
        a.num_computed_tokens = start + 32
        kv.cache_computed(a)
    assert kv.table("a")[:8] == [NULL_BLOCK] * 8  # before the last chunk's window
    b = _req("b", list(range(160)) + [999] * 20)
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 10  # the whole chain, freed blocks included
    b.num_computed_tokens = 160
    free_before = kv.pool.num_free
    assert kv.allocate(b, 20, hit)
    first = (160 - 32 + 1) // BS
    assert kv.table("b") == [NULL_BLOCK] * first + hit[first:] + kv.table("b")[10:]
    assert all(kv.pool.blocks[x].ref_cnt == 0 for x in hit[:first])  # not adopted
    assert all(kv.pool.blocks[x].ref_cnt == 2 for x in hit[first:])  # a's and b's
    assert kv.pool.num_free == free_before - 2  # only b's two new blocks
    kv.free(b)
    kv.free(a)
    evict = _req("e", range(5000, 5000 + 40 * BS - 1))
    assert kv.allocate(evict, 40 * BS - 1)  # takes every block: the cache is evicted
    kv.free(evict)
    assert kv.find_cached_prefix(_req("c", range(100))) == []
    kv.leak_check()


class FakeModel:
    """Runs scheduled batches: each written KV slot records (request, position); before a
    row runs, every key its queries can see must be present and hold what that token
    wrote. Swaps copy slot records between device and host blocks."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.device: dict[tuple[int, int], tuple[str, int]] = {}
        self.host: dict[tuple[int, int], tuple[str, int]] = {}

    def step(self, sched: Scheduler, batch) -> None:
        for dev, host in batch.swap_out:
            assert len(dev) == len(host)
            for d, h in zip(dev, host):
                for o in range(BS):
                    self.host[(h, o)] = self.device.get((d, o))
        for host, dev in batch.swap_in:
            assert len(dev) == len(host)
            for h, d in zip(host, dev):
                for o in range(BS):
                    self.device[(d, o)] = self.host.get((h, o))
        for req, n in batch.entries:
            table, p0 = sched.kv.table(req.request_id), req.num_computed_tokens
            if n == 1:  # a decode row holds at most window/block_size + 2 blocks
                assert _held(sched.kv, req.request_id) <= BOUND
            for q in range(p0, p0 + n):
                for k in range(max(0, q - self.window + 1), p0):
                    blk = table[k // BS]
                    assert blk != NULL_BLOCK, (req.request_id, q, k)
                    assert self.device.get((blk, k % BS)) == (req.request_id, k), (q, k)
                self.device[(table[q // BS], q % BS)] = (req.request_id, q)
            req.num_computed_tokens += n
            sched.kv.cache_computed(req)
            if req.num_computed_tokens == len(req.token_ids):
                req.token_ids.append(7)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_scheduler_keeps_every_visible_key_through_preemption(mode: str) -> None:
    """Three requests decoding past the window fill the pool; a more important long
    prompt arrives and preempts one to be admitted and one more as its prefill grows (a
    running prefill takes blocks from less important requests rather than wait for
    them): preemption swaps out (or drops) only held blocks,
    and every visible key is right at every step; at most BOUND blocks per decode row;
    no leak at the end."""
    kv = KVCacheManager(3 * BOUND, BS, sliding_window=WINDOW)
    swap = SwapPool(4 * BOUND)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=96, preemption_mode=mode),
                      swap)
    model = FakeModel(WINDOW)
    reqs = [_req(x, range(i * 1000, i * 1000 + 100 + 20 * i), 600)
            for i, x in enumerate("abd")]
    for r in reqs:
        sched.add(r)
    preempted = 0
    for step in range(3000):
        if step == 300:
            reqs.append(_req("c", range(5000, 5600), 300, priority=-1))
            sched.add(reqs[-1])
        batch = sched.schedule()
        preempted += len(batch.preempted)
        model.step(sched, batch)
        for r in list(sched.running):
            if len(r.token_ids) - len(r.prompt_token_ids) >= r.params.max_tokens:
                sched.remove(r)
        if not sched.has_work():
            break
    assert not sched.has_work() and preempted == 2
    kv.leak_check()
    swap.leak_check()


def _windowed_engine(model_dir, backend: str, num_blocks: int, window: int | None,
                     slide_kv: bool, monkeypatch):
    """The tiny Llama forced to a sliding window in every layer (its attention modules'
    LayerAttention replaced); slide_kv: the KV manager frees blocks behind the window."""
    from engine.attention.base import LayerAttention
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    monkeypatch.setattr(LLMEngine, "_kv_window", lambda self: window if slide_kv else None)
    eng = LLMEngine(EngineConfig.from_flat(
        model=str(model_dir), dtype="float32", num_kv_blocks=num_blocks, max_model_len=4200,
        max_num_batched_tokens=64, attention_backend=backend))
    layers = [m for m in eng.runner.model.modules() if isinstance(getattr(m, "params", None),
                                                                  LayerAttention)]
    assert layers
    for m in layers if window is not None else ():
        m.params = LayerAttention(m.params.scale, window=window)
    return eng


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    from tests.utils import make_tiny_llama

    # untied and unscaled: its samples stay varied over thousands of tokens (the tied
    # tiny Llama soon repeats one token, whatever the window)
    return make_tiny_llama(tmp_path_factory.mktemp("long-llama"), max_pos=4200, tie=False,
                           embed_scale=1.0)


def test_freed_blocks_generate_what_the_full_cache_does(long_llama, monkeypatch) -> None:
    """4,000-token seeded generations with a 256-token window: the naive backend over the
    whole cache, one request at a time, and sdpa running two at once in a pool of
    2 * (window/block_size + 2) + 4 blocks that frees what the window left behind give
    the same tokens (and the window matters: without it the tokens differ)."""
    from core.sampling import SamplingParams as SP

    params = SP(max_tokens=4000, temperature=1.0, seed=7, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(100, 300, 3))]
    full = _windowed_engine(long_llama, "naive", 300, WINDOW, False, monkeypatch)
    want = [full.generate([p], params)[0].token_ids for p in prompts]
    full.leak_check()
    plain = _windowed_engine(long_llama, "naive", 300, None, False, monkeypatch)
    short = SP(max_tokens=600, temperature=1.0, seed=7, ignore_eos=True)
    assert plain.generate(prompts[:1], short)[0].token_ids != want[0][:600]
    slid = _windowed_engine(long_llama, "sdpa", 2 * BOUND + 4, WINDOW, True, monkeypatch)
    got = [c.token_ids for c in slid.generate(prompts, params)]
    slid.leak_check()
    assert [len(g) for g in got] == [4000, 4000] and got == want
