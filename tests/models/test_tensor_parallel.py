"""--tensor-parallel-size 2 on two gloo ranks (this process is rank 0, one rank process
beside it, one core each) against the same engine at 1, fp32, on every family's small
random checkpoint (tests/models/families.py): greedy tokens equal token for token,
last-position logits within 1e-4. One group serves the whole module (its ranks start
once); each engine builds its shards on it and drops them on close. The module ends by
checking that the rank process is gone."""
from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
import torch

from core.sampling import SamplingParams
from core.kv.layout import SCALE_BYTES
from engine.config import EngineConfig
from engine.kv_cache import quant as kv_quant
from engine import model_runner
from engine.llm_engine import LLMEngine
from engine.models import base
from engine.models.weights import Cut
from engine.parallel import collectives
from engine.parallel.group import TPGroup
from kvtransfer.base import block_view
from tests.models.adapters import ALL_LINEARS, make_adapter
from tests.models.families import (FAMILIES, build_checkpoint, engine_last_logits,
                                   load_reference, prompts)
from tests.models.gguf_files import write_gguf

NEW_TOKENS = 32
LOGIT_ATOL = 1e-4
ACCEPTANCE = ("llama", "mistral", "mixtral")
"""Llama, a sliding-window family and an MoE family: 16 prompts alone and batched."""


@pytest.fixture(scope="module")
def group():
    g = TPGroup(2)
    pids = g.pids
    yield g
    g.shutdown()
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE], "a rank outlived the group"


def config(path, tp: int, **kw) -> EngineConfig:
    flags = dict(model=str(path), dtype="float32", quantization="none", max_model_len=256,
                 num_kv_blocks=256, block_size=8, attention_backend="sdpa", compile=False,
                 tensor_parallel_size=tp)
    return EngineConfig.from_flat(**{**flags, **kw})


def compare(path, group: TPGroup, alone: bool, count: int, swaps: bool = False,
            packed: bool = False, **kw) -> None:
    """TP 2 against TP 1 on one checkpoint: tokens (batched, and alone when asked) and
    last-position logits; both engines end with a leak check. swaps: both engines must
    have swapped blocks out and in. packed: both packed every linear, none left dense."""
    one = LLMEngine(config(path, 1, **kw))
    two = LLMEngine(config(path, 2, **kw), tp_group=group)
    try:
        if packed:
            for q in (one.runner.quant, two.runner.quant):
                assert q is not None and not q.fallbacks, q
            assert two.runner.quant.packed == one.runner.quant.packed
        batch = prompts(count, seed=1)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        want = [c.token_ids for c in one.generate(batch, params)]
        assert [c.token_ids for c in two.generate(batch, params)] == want
        if swaps:
            assert [e.stats.swap_in_bytes > 0 for e in (one, two)] == [True, True]
            assert two.stats.swap_in_bytes * 2 == one.stats.swap_in_bytes  # half the heads each
        if alone:
            assert [two.generate([ids], params)[0].token_ids for ids in batch] == want
        worst = max((engine_last_logits(one, ids) - engine_last_logits(two, ids)).abs().max().item()
                    for ids in prompts(4, seed=2, low=20, high=60))
        assert worst <= LOGIT_ATOL, f"last-position logits differ by {worst:.2e}"
        one.leak_check()
        two.leak_check()
    finally:
        two.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tp2_equals_tp1(family: str, checkpoint, group) -> None:
    """8 prompts batched (16 alone and batched for the acceptance families), 32 tokens."""
    big = family in ACCEPTANCE
    compare(checkpoint(family), group, alone=big, count=16 if big else 8)


def test_fewer_kv_heads_than_ranks_replicates_them(tmp_path, group) -> None:
    """One KV head, two ranks: each rank holds a copy of it and half the query heads."""
    compare(build_checkpoint(tmp_path, "llama", num_key_value_heads=1), group,
            alone=False, count=8)


def test_row_split_biases_at_tp2_equal_tp1(tmp_path, group) -> None:
    """Biases on every linear (attention_bias, mlp_bias): o_proj's and down_proj's are
    added once, by rank 0 (rank 1 holds zeros), q/k/v's and gate/up's are split."""
    path = build_checkpoint(tmp_path, "llama", attention_bias=True, mlp_bias=True)
    compare(path, group, alone=False, count=8)


def test_a_rank_allocates_only_its_share_of_the_weights(checkpoint, group, monkeypatch) -> None:
    """The split is made on the meta skeleton: what a rank allocates for its weights is
    its share (about half at TP 2, the norms and router replicated), never the whole
    model, and each checkpoint tensor is cut as it loads."""
    allocated = []

    def materialize(model, device):
        allocated.append(sum(p.numel() * p.element_size() for p in model.parameters()))
        return base.materialize(model, device)

    monkeypatch.setattr(model_runner, "materialize", materialize)
    for family in ("llama", "mixtral"):
        LLMEngine(config(checkpoint(family), 1))  # what the whole model allocates
        two = LLMEngine(config(checkpoint(family), 2), tp_group=group)
        try:
            held = sum(p.numel() * p.element_size() for p in two.runner.model.parameters())
            whole, share = allocated[-2:]
            assert share == held, f"{family}: rank 0 allocated {share} bytes, holds {held}"
            assert share < 0.55 * whole, f"{family}: rank 0 allocated {share} of {whole} bytes"
        finally:
            two.close()


def test_a_row_split_reads_whole_rows_only_for_int8(checkpoint, group, monkeypatch) -> None:
    """int8 packing scales a row-split weight by its whole rows, so those rows are read
    whole as it loads (Cut.absmax); without int8 a rank reads only its columns of it
    (the mapped file's pages of the other columns are never touched). Llama's 2 layers
    have 2 row splits each (o_proj, down_proj)."""
    whole_rows = []
    real = Cut.load

    def load(self, param, index, w):
        whole_rows.append(self.absmax is not None)
        return real(self, param, index, w)

    monkeypatch.setattr(Cut, "load", load)
    for quantization, rows in (("none", 0), ("int8", 4)):
        whole_rows.clear()
        LLMEngine(config(checkpoint("llama"), 2, quantization=quantization),
                  tp_group=group).close()
        assert sum(whole_rows) == rows, (quantization, whole_rows)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_expert_parallel_at_tp2_equals_tp1(family: str, checkpoint, group) -> None:
    """--enable-expert-parallel: each rank keeps 4 of the 8 whole experts and runs the
    pairs routed to them; the MLP all-reduce sums the two shares. 8 prompts batched and
    alone, 32 tokens: TP 1's greedy tokens, last-position logits within 1e-4."""
    compare(checkpoint(family), group, alone=True, count=8, enable_expert_parallel=True)


def test_expert_parallel_keeps_whole_experts(checkpoint, group) -> None:
    """Rank 0 holds experts 0-3 at their full width (the split that is not expert
    parallel keeps all 8 at half width)."""
    eng = LLMEngine(config(checkpoint("mixtral"), 2, enable_expert_parallel=True),
                    tp_group=group)
    try:
        ex = eng.runner.model.model.layers[0].mlp.experts
        assert (ex.first, ex.owned, ex.num_experts) == (0, 4, 8)
        assert ex.gate_up.shape[:2] == (4, 2 * ex.inter) and ex.down.shape[0] == 4
    finally:
        eng.close()


def test_expert_parallel_that_does_not_divide_the_experts_is_refused(tmp_path) -> None:
    path = build_checkpoint(tmp_path, "mixtral", num_local_experts=3)
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 does not divide the "
                                         r"model's 3 experts \(--enable-expert-parallel\)"):
        LLMEngine(config(path, 2, enable_expert_parallel=True))
    assert psutil.Process().children(recursive=True) == before


def test_a_split_that_does_not_divide_is_refused_before_any_rank_starts(checkpoint) -> None:
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 does not divide the "
                                         r"model's 4 attention heads"):
        LLMEngine(config(checkpoint("llama"), 3))
    assert psutil.Process().children(recursive=True) == before


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", "self"])
def test_speculative_decoding_at_tp2_equals_tp1(checkpoint, group, method: str) -> None:
    """Guesses come from rank 0 (a draft model runs there, unsplit, with its own cache;
    here the target's own checkpoint, so most guesses hold), or, for self:1, from the
    target's first layer, a pass every rank runs on its shard; the verification rows
    (1 + k tokens a sequence) run on every rank like any step: greedy tokens at TP 2
    with speculation equal TP 1's without, and guesses were verified (prompts that
    repeat themselves, so the n-gram and suffix proposers find matches)."""
    path = checkpoint("llama")
    one = LLMEngine(config(path, 1))
    draft = ({"speculative_model": str(path)} if method == "draft"
             else {"speculative_model": "self:1"} if method == "self" else {})
    name, method = ("self_draft", "draft") if method == "self" else (method, method)
    two = LLMEngine(config(path, 2, speculative_method=method, num_speculative_tokens=3,
                           **draft), tp_group=group)
    try:
        batch = [p * 4 for p in prompts(6, seed=9, low=4, high=8)]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        want = [c.token_ids for c in one.generate(batch, params)]
        assert [c.token_ids for c in two.generate(batch, params)] == want
        counters = two.speculator.counters.get(name)
        assert counters.verifications > 0 and counters.accepted > 0, counters
        two.leak_check()
    finally:
        two.close()


@pytest.mark.parametrize("family, targets, quantization", [
    ("llama", ALL_LINEARS, "none"),
    ("llama", ("q_proj", "v_proj", "o_proj", "down_proj"), "int8"),
    ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), "none")])
def test_lora_adapters_at_tp2_equal_tp1(tmp_path, checkpoint, group, family: str,
                                        targets: tuple[str, ...], quantization: str) -> None:
    """Each rank keeps its part of every adapter (B's rows where its linear is split by
    rows, A's columns where by columns; the all-reduce sums base and adapter): three
    adapters over two slots, so slots are refilled while the batch runs (rank 0 sends
    each adapter to the other rank as it makes it resident). A batch mixing them with
    the base model, and each adapter on its own, gives TP 1's greedy tokens; every
    adapter changes them. Phi-3's fused q/k/v is one shard cut in three places; int8
    wraps packed linears."""
    pytest.importorskip("peft", reason="PEFT writes the adapters")
    path = checkpoint(family)
    base = load_reference(path)
    modules = tuple(f"{name}={make_adapter(base, tmp_path / name, seed, targets, r=4 * seed)[0]}"
                    for seed, name in enumerate("abc", start=1))
    kw = dict(lora_modules=modules, max_loras=2, quantization=quantization)
    if quantization != "none":
        kw["quant_packed_max_rows"] = 256  # every step on the packed kernels
    one = LLMEngine(config(path, 1, **kw))
    two = LLMEngine(config(path, 2, **kw), tp_group=group)
    try:
        batch = prompts(8, seed=6)
        names = ["a", "", "b", "a", "c", "", "b", "a"]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        runs = []
        for eng in (one, two):
            mixed = [c.token_ids for c in eng.generate(batch, params, names[:4])]
            mixed += [c.token_ids for c in eng.generate(batch[4:], params, names[4:])]
            each = {n: [c.token_ids for c in eng.generate(batch[:3], params, [n] * 3)]
                    for n in ("", "c", "a", "b")}
            runs.append((mixed, each))
            eng.leak_check()
        assert runs[1] == runs[0]
        each = runs[0][1]
        assert all(each[n] != each[""] for n in "abc")
    finally:
        two.close()


@pytest.mark.parametrize("method", ["Q8_0", "Q4_0", "int8", "int4"])
def test_packed_weights_at_tp2_equal_tp1(tmp_path, checkpoint, group, method: str) -> None:
    """Each rank packs its shard with the codes and scales TP 1 gives that part of the
    weight (a GGUF's blocks cut at block boundaries; int8's scales over the whole row),
    so with every step on the packed kernels, TP 2 equals TP 1 to summation order."""
    path = checkpoint("llama")
    if method.startswith("Q"):  # the file's own blocks (--quantization auto)
        path, method = write_gguf(path, "llama", tmp_path / f"{method}.gguf", qtype=method), "auto"
    compare(path, group, alone=False, count=8, packed=True, quantization=method,
            quant_packed_max_rows=256)


def test_the_host_kv_tier_at_tp2_equals_tp1(checkpoint, group) -> None:
    """The host tier's demotions and promotions go through the runner's copy_blocks, so
    each rank copies its own heads: a prompt whose blocks other prompts evicted from a
    device pool of 8 blocks comes back from host memory, with TP 1's tokens and hits."""
    path = checkpoint("llama")
    prompt, *fillers = prompts(4, seed=5, low=40, high=41)  # 5 full blocks of 8 each
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        eng = LLMEngine(config(path, tp, num_kv_blocks=8, max_model_len=64,
                               preemption_mode="recompute", swap_space=0,
                               kv_offload_cpu_gib=64 * 4096 / (1 << 30)),
                        tp_group=group if tp == 2 else None)
        try:
            got = [eng.generate([p], params)[0] for p in [prompt, *fillers, prompt]]
            runs.append(([c.token_ids for c in got], got[-1].cached_by_tier,
                         eng.tiers.stats.host_hits))
            eng.leak_check()
        finally:
            eng.close()
    assert runs[1] == runs[0]
    assert runs[0][1] == (40, 0) and runs[0][2] == 5  # every prompt block from the host


def test_the_disk_kv_tier_at_tp2_is_tp1s_and_shares_its_files(tmp_path, checkpoint, group) -> None:
    """A block file holds every KV head, so a group gathers a spilled host block from
    its ranks before the writer gets it, and scatters a block read from disk to them:
    a prompt written to disk by a TP 2 engine (a host tier of 2 blocks, so its 5 blocks
    spill) comes back into a fresh TP 1 engine from those files, and one written at TP 1
    into a fresh TP 2 engine, each with the tokens of a cold run."""
    path = checkpoint("llama")
    prompt, *fillers = prompts(4, seed=5, low=40, high=41)  # 5 full blocks of 8 each
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def engine(tp: int, directory) -> LLMEngine:
        return LLMEngine(config(path, tp, num_kv_blocks=8, max_model_len=64,
                                preemption_mode="recompute", swap_space=0,
                                kv_offload_cpu_gib=2 * 4096 / tp / (1 << 30),
                                kv_offload_dir=str(directory), kv_offload_disk_gib=0.01),
                         tp_group=group if tp == 2 else None)

    cold = None
    for writer, reader in ((2, 1), (1, 2)):
        directory = tmp_path / f"tp{writer}"
        eng = engine(writer, directory)
        try:
            got = [eng.generate([p], params)[0].token_ids for p in [prompt, *fillers]]
            cold = cold or got[0]
            assert got[0] == cold
            eng.leak_check()
        finally:
            eng.close()  # the disk writer's queue written
        assert eng.tiers.disk.stats.written >= 5
        eng = engine(reader, directory)
        try:
            done = eng.generate([prompt], params)[0]
            assert (done.token_ids, done.cached_by_tier) == (cold, (0, 40))
            assert eng.tiers.stats.disk_hits == 5
            assert (eng.tiers.disk.stats.corrupt, eng.tiers.disk.stats.foreign) == (0, 0)
            eng.leak_check()
        finally:
            eng.close()


@pytest.mark.parametrize("policy, kv_heads", [
    ("streaming:sinks=4,window=28", 2),  # 1 sink block + 4 recent blocks of 8
    ("h2o:heavy=8,recent=24,halflife=12,score=mean", 2),  # each rank weights queries alike
    ("h2o:heavy=8,recent=24", 1)])
def test_bounded_kv_policies_at_tp2_equal_tp1(tmp_path, checkpoint, group, policy: str,
                                              kv_heads: int) -> None:
    """Generating 120 tokens past prompts of 12-30 under a budget of 32, TP 2's greedy
    tokens equal TP 1's. Streaming drops blocks and every rank re-rotates its heads'
    keys (Op.SHIFT). h2o: rank 0 keeps every head's scores, each rank sends it its heads'
    share of a step, and rank 0's victims are evicted by every rank from its own heads
    (Op.EVICT); with one KV head both ranks hold it, and its score is the sum of their
    query heads' shares; under score=mean rank 0 also keeps each slot's arrival. The
    request's scores equal TP 1's within fp32 summation order, its arrivals exactly."""
    path = (checkpoint("llama") if kv_heads == 2
            else build_checkpoint(tmp_path, "llama", num_key_value_heads=1))
    batch = prompts(4, seed=7, low=12, high=30)
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    got, scores, arrivals = [], [], []
    for tp in (1, 2):
        eng = LLMEngine(config(path, tp, kv_policy=policy, allow_request_kv_policy=True),
                        tp_group=group if tp == 2 else None)
        try:
            got.append([c.token_ids for c in eng.generate(batch, params)])
            if policy.startswith("h2o"):
                rid = eng.add_request(batch[0], SamplingParams(max_tokens=40, temperature=0.0,
                                                               ignore_eos=True))
                req = eng.requests[rid]
                while not req.finished:
                    eng.step()
                scores.append(req.kv_scores.clone())
                arrivals.append(req.kv_arrivals)
            eng.leak_check()
        finally:
            eng.close()
    assert got[1] == got[0]
    if scores:
        assert scores[1].shape == scores[0].shape == (2, kv_heads, 32)
        assert torch.allclose(scores[1], scores[0], atol=1e-4), (scores[1] - scores[0]).abs().max()
    if "score=mean" in policy:
        assert torch.equal(arrivals[1], arrivals[0])
        assert int(arrivals[0].max()) == len(batch[0]) + 39  # the last token computed


def _prompt_logprobs(eng: LLMEngine, batch: list[list[int]], params: SamplingParams) -> list:
    ids = [eng.add_request(p, params) for p in batch]
    got: dict[str, list] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.prompt_logprobs is not None:
                got.setdefault(o.request_id, []).extend(o.prompt_logprobs)
    eng.leak_check()
    return [got[i] for i in ids]


def test_prompt_logprobs_at_tp2_equal_tp1(checkpoint, group) -> None:
    """Rank 0 turns the prompt rows' logits into logprobs; the other rank runs the same
    LM-head calls (their all-gathers) from the step's prompt_chunks. Chunked prefill (16
    tokens a step), three prompts batched: every logprob within 1e-4 of TP 1's, the same
    top-3 tokens (but where TP 1's own top-3 values are within 1e-4 of each other)."""
    path = checkpoint("llama")
    one = LLMEngine(config(path, 1, max_num_batched_tokens=16))
    two = LLMEngine(config(path, 2, max_num_batched_tokens=16), tp_group=group)
    try:
        batch = prompts(3, seed=4, low=20, high=50)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
        want, got = _prompt_logprobs(one, batch, params), _prompt_logprobs(two, batch, params)
    finally:
        two.close()
    for prompt, a, b in zip(batch, want, got):
        assert len(a) == len(b) == len(prompt) - 1
        for x, y in zip(a, b):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            values = [v for _, v in x.top]
            assert max(abs(v - w) for v, (_, w) in zip(values, y.top)) < 1e-4
            tie = any(abs(u - v) < 1e-4 for u, v in zip(values, values[1:]))
            assert tie or [t for t, _ in x.top] == [t for t, _ in y.top]


def _ranks_of(pid: int) -> list[psutil.Process]:
    """Live rank processes that a rank 0 of process id ``pid`` started."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "engine.parallel.follower" in cmd and cmd[-1] == str(pid):
            out.append(p)
    return out


def test_tandem_generate_at_tp2_prints_tp1_text_and_leaves_no_rank(checkpoint) -> None:
    args = [sys.executable, "-m", "tandem.cli", "generate", "hello", "--model",
            str(checkpoint("llama")), "--max-tokens", "12", "--dtype", "float32",
            "--quantization", "none", "--no-compile", "--attention-backend", "sdpa"]
    one = subprocess.run(args, capture_output=True, text=True, timeout=300)
    proc = subprocess.Popen(args + ["--tensor-parallel-size", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert one.returncode == 0 and proc.returncode == 0, one.stderr + err
    assert out == one.stdout and len(out) > 1
    assert _ranks_of(proc.pid) == []


def test_workers_at_tp2_refuse_the_in_process_kv_transfer() -> None:
    """local moves one tensor of one process; tcp and nixl serve a group (the handoffs:
    tests/services/test_tp_handoff.py)."""
    from worker.config import KVTransferConfig, WorkerConfig

    with pytest.raises(ValueError, match="--kv-transfer local is not supported with "
                                         "--tensor-parallel-size 2"):
        WorkerConfig(EngineConfig.from_flat(tensor_parallel_size=2), KVTransferConfig("local"))
    for backend in ("tcp", "nixl"):
        WorkerConfig(EngineConfig.from_flat(tensor_parallel_size=2), KVTransferConfig(backend))


@pytest.mark.parametrize("kv_heads, kv_cache_dtype", [(2, "auto"), (1, "auto"), (2, "int8")])
def test_a_group_exports_and_imports_every_kv_head_of_its_blocks(tmp_path, checkpoint, group,
                                                                 kv_heads: int,
                                                                 kv_cache_dtype: str) -> None:
    """export_kv gathers a prompt's blocks from both ranks with every KV head, as TP 1
    holds them (values within 1e-4: the ranks compute them in other sums); import_kv
    scatters them into other blocks, each rank its heads, and exporting those gives the
    same bytes. With one KV head both ranks hold a copy: the export carries it once.
    int8 KV: each head's rows move whole, codes with their bf16 scale; decoded, each row
    is within two codes of TP 1's (the ranks' other sums may round a code or a scale the
    other way)."""
    path = (checkpoint("llama") if kv_heads == 2
            else build_checkpoint(tmp_path, "llama", num_key_value_heads=1))
    one = LLMEngine(config(path, 1, kv_cache_dtype=kv_cache_dtype))
    two = LLMEngine(config(path, 2, kv_cache_dtype=kv_cache_dtype), tp_group=group)
    try:
        ids = prompts(1, seed=4, low=24, high=25)[0]  # 3 whole blocks of 8
        tables = [eng.kv.pool.allocate(3) for eng in (one, two)]
        for eng, table in zip((one, two), tables):
            eng.runner.prompt_logits(ids, table)
        want = block_view(one.runner.kv)[tables[0]]
        got = two.runner.export_kv(tables[1])
        assert got.shape == want.shape == (3, one.runner.block_bytes)
        assert two.runner.block_bytes * (2 if kv_heads == 2 else 1) == one.runner.block_bytes
        if kv_cache_dtype == "int8":  # [n, L, 2, B, heads, head_dim codes + bf16 scale]
            rows = [b.view(torch.int8).view(3, 2, 2, 8, kv_heads, -1) for b in (got, want)]
            values = [kv_quant.decode(r, "int8", torch.float32) for r in rows]
            step = torch.maximum(*[r[..., -SCALE_BYTES:].contiguous().view(torch.bfloat16).float()
                                   for r in rows])  # one code of each row
            apart = (values[0] - values[1]).norm(dim=-1, keepdim=True)
            assert (apart <= 2 * step * values[0].shape[-1] ** 0.5).all()
        else:
            assert torch.allclose(got.view(torch.float32), want.view(torch.float32),
                                  atol=LOGIT_ATOL)
        spare = two.kv.pool.allocate(3)
        two.runner.import_kv(spare, want)
        assert torch.equal(two.runner.export_kv(spare), want)
        for eng, table in ((one, tables[0]), (two, tables[1]), (two, spare)):
            eng.kv.pool.free(table)
        one.leak_check()
        two.leak_check()
    finally:
        two.close()


def test_swap_preemption_and_int8_kv_per_rank(checkpoint, group) -> None:
    """A pool too small for the batch: requests are preempted to the host pool and
    swapped back on every rank (rank 0 sends each swap), over int8 KV blocks; the
    tokens equal TP 1's under the same pressure."""
    kw = dict(kv_cache_dtype="int8", max_model_len=128, num_kv_blocks=40,
              preemption_mode="swap", enable_prefix_caching=False)
    compare(checkpoint("llama"), group, alone=False, count=8, swaps=True, **kw)


def _choices(eng: LLMEngine, ids: list[int], params: SamplingParams) -> list[list[int]]:
    """Each choice's tokens of one n > 1 request, by index."""
    eng.add_request(ids, params)
    out: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.index, []).extend(o.new_token_ids)
    return [out[j] for j in sorted(out)]


def test_forked_choices_copy_their_shared_block_on_every_rank(checkpoint, group) -> None:
    """n = 3 forks the prompt's blocks; each choice's first write into the shared partial
    block copies it first (copy-on-write), on every rank (rank 0 sends the copies with
    the swaps). Without the copies on rank 1 its half of the heads would read another
    block's bytes and the tokens would differ from TP 1's."""
    path = checkpoint("llama")
    one = LLMEngine(config(path, 1))
    two = LLMEngine(config(path, 2), tp_group=group)
    try:
        ids = prompts(1, seed=3, low=13, high=14)[0]  # 13 tokens: a partial block is shared
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, n=3)
        want = _choices(one, ids, params)
        assert len(want) == 3 and want[0] == want[1] == want[2]
        assert _choices(two, ids, params) == want
        one.leak_check()
        two.leak_check()
    finally:
        two.close()


def test_the_collective_timer_counts_every_collective_only_while_open(checkpoint, group) -> None:
    """bench/tp_allreduce.py's timer (engine/parallel/collectives.py): off unless open;
    open, it counts rank 0's collectives of a step and their bytes exactly. The llama
    checkpoint: 2 layers, hidden 64, vocabulary 320, fp32. A forward of T rows runs one
    all-reduce of [T, 64] after the embedding and two per layer, and one all-gather of
    the last row's [1, 160] logits shard."""
    eng = LLMEngine(config(checkpoint("llama"), 2), tp_group=group)
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        eng.generate([list(range(3, 13))], params)
        assert collectives._timer is None
        with collectives.timing_collectives() as timer:
            with pytest.raises(RuntimeError, match="already open"):
                with collectives.timing_collectives():
                    pass
            eng.generate([list(range(20, 30))], params)  # a prefill of 10 rows, a decode of 1
        assert collectives._timer is None
        assert timer.calls == 2 * (1 + 2 * 2 + 1)
        assert timer.bytes == sum(5 * rows * 64 * 4 + 160 * 4 for rows in (10, 1))
        assert timer.seconds > 0
        eng.leak_check()
    finally:
        eng.close()
