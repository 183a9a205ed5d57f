"""The compiled decode step (engine/compile/) against the eager one on the tiny model, fp32:
token-identical, batch-invariant, interruptible, and a compile failure falls back loudly.
The module's engine runs buckets 1 and 2 as one graph and bucket 4 per layer."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from engine.compile.decode import CompiledDecode, decode_buckets
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from core.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine(path: Path, compile: bool, quantization: str = "none") -> LLMEngine:
    eng = LLMEngine(EngineConfig.from_flat(model=str(path), dtype="float32", num_kv_blocks=128,
                                           max_num_seqs=8, compile=compile, compile_max_batch=4,
                                           compile_graph_max_batch=2,
                                           quantization=quantization, quant_packed_max_rows=2))
    if compile:
        assert set(eng.runner.compiled.timings) == {1, 2, 4}
        eng.runner.compiled.slower.clear()  # test every compiled bucket, faster or not
        eng.runner.compiled.any_slower = False  # and the prefill steps
    return eng


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 300 + 3 for j in range(5 + 3 * i)] for i in range(n)]


def _step_hidden(eng: LLMEngine, one_graph: bool) -> torch.Tensor:
    """Hidden states of one batch-1 decode step at position 0 in block 0 (which the test's
    later requests overwrite): the compiled engine's one-graph step, or its eager one."""
    from engine.attention.metadata import build_metadata
    from engine.models.base import EAGER, ForwardContext

    r = eng.runner
    with torch.inference_mode():  # as the engine's steps run: the graph's guards see it
        meta = build_metadata([1], [1], 0, [[0]], r.config.cache.block_size)
        tids, tpos = r.compiled.pad([5], [0], 1)
        return r._bucket_hidden(tids, tpos, ForwardContext(r.kv, meta, r.backend), 1,
                                r.compiled.segments if one_graph else EAGER)


@pytest.fixture(scope="module")
def compiled(tiny_model_dir: Path) -> LLMEngine:
    eng = _engine(tiny_model_dir, compile=True)
    assert eng.runner.compiled.disabled is None
    assert eng.runner.compiled.buckets == [1, 2, 4]
    return eng


@contextmanager
def _step_calls(c: CompiledDecode, each: Callable[[], None] | None = None
                ) -> Iterator[list[tuple[int, int, int]]]:
    """``c.step`` wrapped while the block runs: each call's (rows, lo, hi) is recorded,
    and ``each()`` runs first (a request arriving during that graph)."""
    calls, inner = [], c.step

    def step(model, ids, pos, kv, slots, lo, hi, carry):
        calls.append((ids.shape[0], lo, hi))
        if each is not None:
            each()
        return inner(model, ids, pos, kv, slots, lo, hi, carry)

    c.step = step
    try:
        yield calls
    finally:
        c.step = inner


@pytest.fixture
def graph_calls(compiled: LLMEngine):
    """The (rows, lo, hi) of the graph steps the compiled engine runs while the test does."""
    with _step_calls(compiled.runner.compiled) as calls:
        yield calls


def test_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(5) == [1, 2, 4, 8]
    assert decode_buckets(64)[-1] == 64


def test_compiled_tokens_equal_eager(compiled: LLMEngine, tiny_model_dir: Path) -> None:
    eager = _engine(tiny_model_dir, compile=False)
    prompts = _prompts(6)  # 6 rows: bucket... none (> 4): eager; then 3, 2, 1 as they finish
    params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0, ignore_eos=True)
              for i in range(6)]
    want = [c.token_ids for c in eager.generate(prompts, params)]
    assert [c.token_ids for c in compiled.generate(prompts, params)] == want
    assert [c.token_ids for c in compiled.generate(prompts[:3], params[:3])] == want[:3]
    alone = [compiled.generate([p], GREEDY)[0].token_ids for p in prompts[:3]]
    assert alone == [c.token_ids for c in eager.generate(prompts[:3], GREEDY)]
    compiled.leak_check()


def test_short_decode_steps_run_as_one_graph_and_equal_eager(compiled: LLMEngine,
                                                             tiny_model_dir: Path,
                                                             graph_calls: list) -> None:
    """Decode steps of 1 and 2 rows run as one graph (the fixture's cap is 2; a 3-row step
    takes bucket 4, per layer), and give the eager engine's tokens."""
    c = compiled.runner.compiled
    assert c.layer_groups(1) == c.layer_groups(2) == [(0, 2)] and c.layer_groups(4) is None
    eager = _engine(tiny_model_dir, compile=False)
    prompts = _prompts(3)
    params = [SamplingParams(max_tokens=3 + 4 * i, temperature=0, ignore_eos=True)
              for i in range(3)]
    want = [d.token_ids for d in eager.generate(prompts, params)]
    assert [d.token_ids for d in compiled.generate(prompts, params)] == want
    assert {rows for rows, _, _ in graph_calls} == {1, 2}  # 3 rows ran bucket 4's segments, then 2, then 1
    assert c.graph_failed is None and compiled.runner.fallbacks()["compile"] == []
    compiled.leak_check()


def test_each_model_keeps_its_own_one_graph_steps(compiled: LLMEngine, tiny_model_dir: Path,
                                                  tmp_path: Path) -> None:
    """Dynamo's guards on the model are dropped from one-graph steps, so a second model
    whose step inputs have the same shapes (here: the same checkpoint with another
    rms_norm_eps, a constant the graph bakes in) must get a step function of its own:
    one shared would hand it the first model's graph, and its steps would compute the
    first model's norms. Each engine's one-graph step equals its own eager step."""
    import shutil

    other = tmp_path / "other-eps"
    shutil.copytree(tiny_model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 0.5}))
    b = LLMEngine(EngineConfig.from_flat(model=str(other), dtype="float32", num_kv_blocks=128,
                                         max_num_seqs=8, compile=True, compile_max_batch=2,
                                         compile_graph_max_batch=2))
    for eng in (compiled, b):
        assert eng.runner.compiled.layer_groups(1) is not None
        torch.testing.assert_close(_step_hidden(eng, one_graph=True),
                                   _step_hidden(eng, one_graph=False), atol=1e-5, rtol=1e-5)
        assert eng.runner.compiled.graph_failed is None


def test_compiled_quantized_tokens_equal_eager(tiny_model_dir: Path) -> None:
    """Packed int8 kernels at 1-2 rows, dense at 4: both inside the compiled graphs."""
    a = _engine(tiny_model_dir, compile=True, quantization="int8")
    b = _engine(tiny_model_dir, compile=False, quantization="int8")
    assert a.runner.compiled.layer_groups(1) is not None
    prompts = _prompts(4)
    assert [c.token_ids for c in a.generate(prompts, GREEDY)] == \
        [c.token_ids for c in b.generate(prompts, GREEDY)]
    assert a.runner.compiled.graph_failed is None


def test_prefill_steps_run_the_any_row_segments_and_equal_eager(compiled: LLMEngine,
                                                               tiny_model_dir: Path) -> None:
    """Steps with a prefill (1 to 3 prompts of 5 to 41 tokens, decode rows beside them)
    run the any-row segments compiled at start-up, unpadded, with no graph compiled
    after it: the eager engine's tokens."""
    from engine.models.base import Segments

    c = compiled.runner.compiled
    assert c.any_sizes == [2, 512] and c.any_rows is not None  # no packed linears
    rows = []
    inner = c.any_rows

    def first(model, ids, pos):
        rows.append(ids.shape[0])
        return inner.first(model, ids, pos)

    c.any_rows = Segments(first, inner.middle, inner.last)
    try:
        prompts = [[(11 * i + j) % 300 + 3 for j in range(5 + 12 * i)] for i in range(4)]
        eager = _engine(tiny_model_dir, compile=False)
        want = [d.token_ids for d in eager.generate(prompts, GREEDY)]
        assert [d.token_ids for d in compiled.generate(prompts, GREEDY)] == want
        assert [compiled.generate([p], GREEDY)[0].token_ids for p in prompts[2:]] == want[2:]
    finally:
        c.any_rows = inner
    assert sorted(set(rows))[-1] == sum(map(len, prompts)) and min(rows) >= 2, rows
    assert c.any_failed is None and compiled.runner.fallbacks()["compile"] == []
    compiled.leak_check()


def test_a_prefill_needing_a_graph_not_compiled_at_start_up_runs_eagerly(tiny_model_dir: Path,
                                                                         caplog) -> None:
    """A prefill whose row count needs an any-row graph start-up did not compile (here:
    the packed linears' row limit moved after it, so the graphs' guard on it fails) is
    never compiled while serving: the step runs eagerly, and so do later ones, said in
    the log and as a compile fallback; the tokens are the eager engine's."""
    eng = _engine(tiny_model_dir, compile=True, quantization="int8")
    eager = _engine(tiny_model_dir, compile=False, quantization="int8")
    for e in (eng, eager):
        for m in e.runner.model.modules():
            if hasattr(m, "packed_max_rows"):
                m.packed_max_rows = 5
    c = eng.runner.compiled
    with caplog.at_level(logging.ERROR):
        got = eng.generate([_prompts(1)[0][:4]], GREEDY)[0].token_ids
    assert c.any_rows is None and "compiled step for 4 rows (a prefill) failed" in c.any_failed
    assert "--no-compile" in caplog.text
    assert eng.runner.fallbacks()["compile"] == [c.any_failed]
    assert got == eager.generate([_prompts(1)[0][:4]], GREEDY)[0].token_ids
    prompts = _prompts(3)
    assert [d.token_ids for d in eng.generate(prompts, GREEDY)] == \
        [d.token_ids for d in eager.generate(prompts, GREEDY)]
    eng.leak_check()


def test_compiled_step_is_interruptible(compiled: LLMEngine) -> None:
    """should_stop is asked between layers of a compiled step as of an eager one (3 rows:
    bucket 4, compiled per layer)."""
    for i in range(3):
        compiled.add_request(_prompts(3)[i], GREEDY, request_id=f"low{i}", priority=5)
    compiled.step()
    compiled.step()
    attn = compiled.runner.model.model.layers[0].self_attn
    inner = attn.attend

    def attend(*a, **kw):
        attn.attend = inner
        compiled.interrupt_for(0)
        return inner(*a, **kw)

    attn.attend = attend
    before = compiled.stats.interrupted_steps
    assert compiled.step() == []
    assert compiled.stats.interrupted_steps == before + 1
    while compiled.has_unfinished():
        compiled.step()
    compiled.leak_check()


def test_a_one_graph_step_runs_to_its_end(compiled: LLMEngine, graph_calls: list) -> None:
    """A step run as one graph has no layer to stop between: a more important request
    arriving during it waits for its end (the step's tokens count), then runs."""
    for i in range(2):
        compiled.add_request(_prompts(2)[i], GREEDY, request_id=f"g{i}", priority=5)
    compiled.step()
    compiled.step()  # prefills done: the next step decodes 2 rows as one graph
    before = compiled.stats.interrupted_steps
    with _step_calls(compiled.runner.compiled, lambda: compiled.interrupt_for(0)) as calls:
        outs = compiled.step()
    assert calls == [(2, 0, 2)] and len(outs) == 2 and compiled.stats.interrupted_steps == before
    while compiled.has_unfinished():
        compiled.step()
    compiled.leak_check()


@pytest.fixture(scope="module")
def grouped(tmp_path_factory) -> tuple[LLMEngine, LLMEngine]:
    """A 3-layer tiny model compiled with one-graph steps at 1 row and graphs of one layer
    each above (--compile-graph-layers 1: first, middle and last groups), and its eager
    engine."""
    from tests.utils import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("three-layers"), layers=3)
    kw = dict(model=str(path), dtype="float32", num_kv_blocks=128, max_num_seqs=4,
              compile_max_batch=2, compile_graph_max_batch=1, compile_graph_layers=1)
    eng = LLMEngine(EngineConfig.from_flat(compile=True, **kw))
    eng.runner.compiled.slower.clear()  # test every compiled bucket, faster or not
    return eng, LLMEngine(EngineConfig.from_flat(compile=False, **kw))


def test_decode_steps_above_the_graph_cap_run_in_layer_groups_and_equal_eager(
        grouped: tuple[LLMEngine, LLMEngine]) -> None:
    """With --compile-graph-layers 1, a 2-row decode step (above --compile-graph-max-batch
    1) runs as three graphs, one per layer, each carrying its output to the next; a
    1-row step stays one graph. The tokens are the eager engine's."""
    eng, eager = grouped
    c = eng.runner.compiled
    assert c.layer_groups(1) == [(0, 3)] and c.layer_groups(2) == [(0, 1), (1, 2), (2, 3)]
    prompts = _prompts(2)
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True)
              for i in range(2)]
    with _step_calls(c) as calls:
        got = [d.token_ids for d in eng.generate(prompts, params)]
    assert got == [d.token_ids for d in eager.generate(prompts, params)]
    assert set(calls) == {(2, 0, 1), (2, 1, 2), (2, 2, 3), (1, 0, 3)}, calls
    assert calls[:3] == [(2, 0, 1), (2, 1, 2), (2, 2, 3)]  # in order, every layer once
    assert c.graph_failed is None and eng.runner.fallbacks()["compile"] == []
    eng.leak_check()


def test_a_step_in_layer_groups_is_interrupted_between_them(
        grouped: tuple[LLMEngine, LLMEngine]) -> None:
    """A more important request arriving during a step run in layer groups stops it
    before the next group: nothing of it counts, it is not a graph failure, and the
    requests then finish with the eager engine's tokens."""
    eng, eager = grouped
    c = eng.runner.compiled
    prompts = _prompts(2)
    got: dict[str, list[int]] = {f"grp{i}": [] for i in range(2)}

    def collect(outs) -> list:
        for o in outs:
            got[o.request_id] += o.new_token_ids
        return outs

    for i, p in enumerate(prompts):
        eng.add_request(p, GREEDY, request_id=f"grp{i}", priority=5)
    collect(eng.step())
    collect(eng.step())  # prefills done: the next step decodes 2 rows in three groups
    before, computed = eng.stats.interrupted_steps, eng.num_computed_tokens_total
    with _step_calls(c, lambda: eng.interrupt_for(0)) as calls:
        assert eng.step() == []
    assert calls == [(2, 0, 1)] and eng.stats.interrupted_steps == before + 1
    assert eng.num_computed_tokens_total == computed and c.graph_failed is None
    while eng.has_unfinished():
        collect(eng.step())
    assert [got[f"grp{i}"] for i in range(2)] == \
        [d.token_ids for d in eager.generate(prompts, GREEDY)]
    eng.leak_check()


def test_dynamo_keeps_an_entry_for_every_layer_group_of_every_bucket() -> None:
    """One compiled graph per layer group and bucket: 100 layers in groups of one and
    buckets 1-256 are 900 entries of one code object, more than dynamo's default limits
    (8 per code object, 256 in all), which would refuse the later buckets' graphs at
    start-up."""
    from torch import nn

    from engine.compile import decode as cd

    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(nn.Identity() for _ in range(100))
    c = cd.CompiledDecode(model, torch.device("cpu"), max_rows=256, graph_layers=1)
    assert len(c.buckets) == 9 and len(c.layer_groups(256)) == 100
    config = torch._dynamo.config
    assert min(config.cache_size_limit, config.accumulated_cache_size_limit) >= 900


def test_a_failing_one_graph_step_falls_back_to_the_segments(compiled: LLMEngine,
                                                             tiny_model_dir: Path,
                                                             caplog) -> None:
    """Anything a one-graph step raises (a guard that would compile mid-serving, a kernel
    error) drops one-graph steps: that step and later ones run per layer, said in the log
    and as a compile fallback, with the eager engine's tokens."""
    c = compiled.runner.compiled
    inner = c.step

    def broken(*a):
        raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'")

    c.step = broken
    try:
        with caplog.at_level(logging.ERROR):
            got = compiled.generate([_prompts(1)[0]], GREEDY)[0].token_ids
        assert c.step is None and c.layer_groups(1) is None
        assert c.graph_failed.startswith("one-graph decode step for batch 1 failed: "
                                         "RuntimeError: Detected recompile")
        assert "--compile-graph-max-batch 0" in caplog.text
        assert compiled.runner.fallbacks()["compile"] == [c.graph_failed]
    finally:
        c.step, c.graph_failed = inner, None
    eager = _engine(tiny_model_dir, compile=False)
    assert got == eager.generate([_prompts(1)[0]], GREEDY)[0].token_ids
    compiled.leak_check()


@pytest.mark.parametrize("flag,why", [
    (dict(kv_cache_dtype="int8"), "--kv-cache-dtype int8 is decoded per layer"),
    (dict(attention_backend="naive"), "--attention-backend naive decodes per layer")])
def test_one_graph_steps_are_off_where_their_attention_would_differ(tiny_model_dir: Path,
                                                                    flag: dict, why: str,
                                                                    caplog) -> None:
    """The one-graph step calls the CPU decode kernel on a cache in the compute dtype
    itself: a quantized cache, or a backend whose decode rows are not that kernel, keep
    the per-layer segments (said in the log), never another attention than asked for."""
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32",
                                               num_kv_blocks=64, max_num_seqs=1, compile=True,
                                               compile_max_batch=1, **flag))
    assert eng.runner.compiled.layer_groups(1) is None and eng.runner.compiled.step is None
    assert f"decode steps compile per layer, not as one graph: {why}" in caplog.text


def test_compile_failure_falls_back_and_says_so(tiny_model_dir: Path, caplog) -> None:
    eng = _engine(tiny_model_dir, compile=False)
    c = CompiledDecode(eng.runner.model, eng.runner.device, 1, options={"_raise_error_for_testing": True})
    eng.runner.compiled = c
    with caplog.at_level(logging.ERROR):
        c.warm_up(eng.runner._dummy_decode)
    assert c.disabled and "compiling the decode step for batch 1 failed" in c.disabled
    assert "--no-compile" in caplog.text
    assert c.bucket(1) is None  # every later step runs eagerly
    assert eng.runner.fallbacks()["compile"] == [c.disabled]
    done = eng.generate(_prompts(2), GREEDY)
    assert all(len(d.token_ids) == 12 for d in done)
    eng.leak_check()


def test_constrained_rows_in_a_compiled_step(compiled: LLMEngine, tiny_model_dir: Path) -> None:
    """The grammar masks apply around a compiled decode step as around an eager one:
    the same tokens, and every output validates."""
    from core.guided.spec import GuidedSpec
    from tests.guided_cases import SCHEMAS, assert_valid

    names = ["nested_object", "bounded_int_array", "any_of_objects"]
    params = [SamplingParams(max_tokens=120, guided=GuidedSpec.json_schema(SCHEMAS[n]),
                             temperature=1.0 if i else 0.0, seed=i or None)
              for i, n in enumerate(names)]
    eager = _engine(tiny_model_dir, compile=False)
    want = [c.token_ids for c in eager.generate(_prompts(3), params)]
    got = compiled.generate(_prompts(3), params)
    assert [c.token_ids for c in got] == want
    for name, out in zip(names, got):
        assert out.finish_reason.value == "stop", (name, out.text)
        assert_valid(name, out.text)
    compiled.leak_check()


def test_a_tie_at_start_up_keeps_the_compiled_step(monkeypatch) -> None:
    """A bucket runs eagerly only when its compiled step timed clearly slower (more than
    SLOWER_MARGIN) than the eager one; equal timings, which the host's noise makes of two
    equally fast steps, keep the compiled step."""
    from engine.compile import decode as cd

    c = cd.CompiledDecode(torch.nn.Linear(1, 1), torch.device("cpu"), max_rows=4)
    # per bucket 1, 2, 4: (compiled, eager) seconds
    times = iter([(1.0, 1.0), (1.03, 1.0), (1.2, 1.0)])
    monkeypatch.setattr(cd, "best_pair", lambda a, b, retry_if=None: next(times))
    c.warm_up(lambda rows, segments: None)
    assert c.disabled is None and c.slower == {4}
    assert (c.bucket(1), c.bucket(2), c.bucket(3)) == (1, 2, None)


def test_prefill_steps_that_timed_slower_run_eagerly_and_keep_their_graphs(monkeypatch) -> None:
    """Any-row segments that timed clearly slower than eager at start-up are set aside
    (steps with a prefill run eagerly), not dropped: a flag, as a bucket's ``slower``."""
    from engine.compile import decode as cd

    c = cd.CompiledDecode(torch.nn.Linear(1, 1), torch.device("cpu"), max_rows=2, any_rows=8)
    assert c.any_sizes == [2, 8] and c.any_rows is not None
    times = iter([(1.0, 1.0), (1.0, 1.0), (1.2, 1.0)])  # buckets 1, 2, then the any-row step
    monkeypatch.setattr(cd, "best_pair", lambda a, b, retry_if=None: next(times))
    c.warm_up(lambda rows, segments: None)
    assert c.any_slower and c.any_rows_for(3, decode_only=False) is None
    c.any_slower = False
    assert c.any_rows_for(3, decode_only=False) is c.any_rows


def test_start_up_timings_alternate_and_a_loss_is_timed_again() -> None:
    """best_pair times its two functions in turn (a burst of load slows both alike) and
    times a result that would switch a path off once more, twice as long, before it
    stands."""
    from engine.timing import best_pair

    calls = []
    slow = {"left": 3}

    def a():
        calls.append("a")
        if slow["left"]:
            slow["left"] -= 1
            time.sleep(0.01)

    ta, tb = best_pair(a, lambda: calls.append("b"), reps=3,
                       retry_if=lambda x, y: x > 0.005)
    assert calls == ["a", "b"] * 9  # 3 reps, then 6 more: the first round said "slower"
    assert ta < 0.005 and tb < 0.005
    calls.clear()
    best_pair(lambda: calls.append("a"), lambda: calls.append("b"), reps=2, warmup=1,
              retry_if=lambda x, y: False)
    assert calls == ["a", "b"] * 3


def test_compilation_prints_progress_at_the_default_log_level(monkeypatch, caplog) -> None:
    """A first start compiles for minutes (145 s for `tandem generate` on the 2-core
    EPYC): at the CLI's default --log-level (WARNING) it prints a line when it starts,
    one per bucket with its time, and one at the end, on the tandem.progress logger;
    --log-level ERROR hides them."""
    import logging

    from core.progress import progress, show_progress
    from engine.compile import decode as cd

    show_progress(logging.WARNING)
    assert progress.isEnabledFor(logging.INFO)
    c = cd.CompiledDecode(torch.nn.Linear(1, 1), torch.device("cpu"), max_rows=4)
    monkeypatch.setattr(cd, "best_pair", lambda a, b, retry_if=None: (1.0, 1.0))
    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)  # as the CLI leaves it
    c.warm_up(lambda rows, segments: None)
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.progress"]
    assert lines[0].startswith("compiling the decode step for batch sizes 1,2,4 (inductor "
                               f"caches the code in {cd.inductor_cache_dir()}")
    assert [m.split(" in ")[0] for m in lines[1:4]] == [
        f"compiled decode step {i}/3 (batch {b})" for i, b in ((1, 1), (2, 2), (3, 4))]
    assert lines[4].startswith("compiled decode steps for batches 1,2,4 in ")
    show_progress(logging.ERROR)
    assert not progress.isEnabledFor(logging.INFO)
    show_progress(logging.WARNING)


_ONE_RUN = """
import json, sys
from torch._dynamo.utils import counters
import engine.compile.decode as cd
from engine.compile.decode import vector_width
cd.any_row_sizes = lambda model, rows: []  # the decode bucket is what this test reads
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from core.sampling import SamplingParams
eng = LLMEngine(EngineConfig.from_flat(model=sys.argv[1], dtype="float32", num_kv_blocks=64,
                                       max_num_seqs=1, compile=True, compile_max_batch=1))
eng.runner.compiled.slower.clear()
out = eng.generate([[5, 9, 14, 3, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print(json.dumps({"tokens": out[0].token_ids, "width": vector_width(),
                  "hits": counters["inductor"]["fxgraph_cache_hit"]}))
"""


def _compiled_run(model: Path, cache: Path, capability: str | None) -> dict:
    """One process compiling the decode step into ``cache`` at ATEN_CPU_CAPABILITY
    ``capability`` (None: the CPU's own), and its greedy tokens."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "TANDEM_CPU_CAPABILITY")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = env["TANDEM_CPU_CAPABILITY"] = capability
    done = subprocess.run([sys.executable, "-c", _ONE_RUN, str(model)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cache_filled_at_one_vector_width_is_not_read_at_another(tiny_model_dir,
                                                                    tmp_path) -> None:
    """Inductor's cache key leaves out the vector width it generated code for, so a
    cache filled under ATEN_CPU_CAPABILITY=avx2 and read natively on an AVX-512 CPU ran
    8-wide loops on 16-wide vectors and crashed (as running the suite forced to AVX2,
    then natively, did). The compiled step pins cpp.simdlen to its width: a second
    process at the CPU's own width reads the first one's entries only when that width
    is AVX2's too, and both give the eager step's tokens."""
    first = _compiled_run(tiny_model_dir, tmp_path / "cache", "avx2")
    second = _compiled_run(tiny_model_dir, tmp_path / "cache", None)
    assert first["width"] == 256
    assert (second["hits"] > 0) == (second["width"] == 256), second
    eager = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32",
                                             num_kv_blocks=64, max_num_seqs=1, compile=False))
    want = eager.generate([[5, 9, 14, 3, 7]], SamplingParams(max_tokens=8, temperature=0,
                                                             ignore_eos=True))[0].token_ids
    assert first["tokens"] == second["tokens"] == want


def test_int4_tiles_decode_step_compiles_and_equals_eager(tiny_model_dir) -> None:
    """bf16 int4 weights on our AVX-512 kernel (the tiles layout): the compiled step
    traces their matmul (it read /proc/cpuinfo for the AMX threshold while traced, which
    broke the graph, so the step ran eagerly on every AVX-512 BF16 CPU) and gives the
    eager step's tokens."""
    from engine.quant.packed import INT4_KERNEL

    if INT4_KERNEL.unavailable() is not None:
        pytest.skip(f"int4 kernel: {INT4_KERNEL.unavailable()}")
    kw = dict(model=str(tiny_model_dir), dtype="bfloat16", quantization="int4",
              num_kv_blocks=128, max_num_seqs=4, compile_max_batch=4, quant_packed_max_rows=4)
    compiled = LLMEngine(EngineConfig.from_flat(compile=True, **kw))
    assert compiled.runner.compiled.disabled is None
    assert {m.layout for m in compiled.runner.model.modules() if hasattr(m, "layout")} == {"tiles"}
    compiled.runner.compiled.slower.clear()
    eager = LLMEngine(EngineConfig.from_flat(compile=False, **kw))
    assert ([c.token_ids for c in compiled.generate(_prompts(4), GREEDY)]
            == [c.token_ids for c in eager.generate(_prompts(4), GREEDY)])
