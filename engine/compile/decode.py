"""A compiled decode step: torch.compile'd segments for bucketed batch sizes.

Only the parts of a step between attention calls are compiled (models/base.py
``Segments``: embedding + layer 0 up to attention; one layer's output + the next
layer's q/k/v; the last layer's output + the final norm). Attention itself stays
eager, so it reads the paged cache through whatever backend is configured, and
``should_stop`` is still asked between layers: step interruption works unchanged.
The middle segment is one graph shared by all layers (the layer's weights are
graph inputs), so a bucket costs three compiles, not one per layer.

A decode-only step of n rows runs in the smallest bucket >= n, its input padded
with token 0 at position 0; the padding rows are computed by the segments and
dropped before attention (they never touch the KV cache). On CPU, steps with a prefill
(and decode steps with more rows than the largest bucket) run the same segments compiled
once more with the row count symbolic ("any-row" segments): every segment works row by
row, so one graph serves every row count, unpadded. A Python branch on the row count (a
packed linear's ``packed_max_rows``) splits it into a few graphs, all compiled at
start-up (``any_row_sizes``); a step that would need another runs eagerly, and so does
every later one (``fail_any_rows``), said in the log. LoRA steps and rows owing h2o
scores run eagerly. A 512-token prompt of the embedded model took 394 ms instead of 432
in process (the norms, RoPE, SiLU-mul and residuals fused; docs/performance.md).

Short decode steps (buckets up to ``graph_rows``, --compile-graph-max-batch) run as one
graph instead (models/base.py ``decode_graph``): every layer's attention is the CPU decode
kernel with its KV write in it (``tandem::paged_decode_write``, which declares the cache
it writes), so a step is one compiled call. The segments cost 31 entries into compiled
code a step on the embedded model, each with dynamo's guard check (~370 guards on the
layer modules it is handed) and eager glue around the attention between them: about 4 ms
of a 19 ms batch-1 token on an AVX2-only EPYC (docs/performance.md). The graph's guards
on the model are dropped (``_model_guards``): each model gets its own copy of the step
function, so dynamo never hands one model's graph to another, and the model is complete
(loaded, quantized, prepacked, its paths chosen) before the first compile and never
changes after; the guards on the step's own tensors stay, which tell the buckets apart.
No per-layer check can interrupt such a step, hence the cap on its rows; longer steps
keep the segments and their interruption, or, with --compile-graph-layers N, run as graphs
of N layers each (``decode_graph`` over a range of layers, one graph per group and bucket,
the group's output carried to the next) with should_stop asked between groups: a few
entries into compiled code a step instead of 31, interruptible every N layers. Groups of
10 took the embedded model's decode steps from 23.9 / 31.3 / 58.2 / 90.7 ms to 18.8 /
27.4 / 51.2 / 83.7 ms at 8 / 16 / 32 / 64 rows (one graph: 18.0 / 26.3 / 51.2 / 83.1) on
an AVX-512 EPYC, in process; each bucket so compiled costs about 20 s more at a first
start (docs/performance.md). Off by default for that start-up.
LoRA, a quantized KV cache, CUDA and the naive backend take the segments.

A model that declares a layer uncompilable (models/base.py compile_blocker: the MoE
experts' data-dependent split) is not compiled at all: one progress line says why, and
the runner lists it as a fallback.

On CPU, inductor generates fused C++ for the norms, RoPE, SiLU-mul and residuals
and calls the same GEMM / weight-only kernels. On CUDA the segments are compiled
with mode="reduce-overhead", which captures each of them as a CUDA graph per
bucket. Compiled code is cached on disk by inductor (TORCHINDUCTOR_CACHE_DIR,
default /tmp/torchinductor_$USER), so a restart recompiles much faster.

Inductor's cache key leaves out the CPU vector width it generated code for (picked
from the CPU's flags, or ATEN_CPU_CAPABILITY), so one cache directory read by two
widths (a cache filled with ATEN_CPU_CAPABILITY=avx2 and read natively on an AVX-512
CPU, or one directory shared by nodes of both kinds) ran 8-wide loops on 16-wide
vectors and crashed. The CPU segments pin ``cpp.simdlen`` to the width picked here,
which puts it in the key: an entry of another width misses and is compiled anew.
"""
from __future__ import annotations

import logging
import time
import types
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves

from core.progress import progress
from engine.models.base import (EAGER, CausalLM, Segments, compile_blocker, decode_graph,
                                first_segment, last_segment, middle_segment)
from engine.timing import best_pair

log = logging.getLogger(__name__)


SLOWER_MARGIN = 1.05
"""A bucket runs eagerly only when its compiled step timed more than 5% slower than the
eager one at start-up: a tie (within the host's noise) keeps the compiled step."""


def decode_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= max_rows."""
    out = [1]
    while out[-1] < max_rows:
        out.append(out[-1] * 2)
    return out


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled code (TORCHINDUCTOR_CACHE_DIR or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return cache_dir()


def vector_width() -> int | None:
    """The SIMD width in bits inductor generates CPU code for in this process (None: no
    vector ISA, scalar code)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    isa = pick_vec_isa()
    return isa.bit_width() if isa else None


def cpu_options(options: dict | None = None) -> dict:
    """torch.compile options for CPU code: ``options`` with ``cpp.simdlen`` pinned to
    this process's vector width, which puts the width in inductor's cache key (module
    docstring). Every CPU compile should take them."""
    out = dict(options or {})
    width = vector_width()
    if width is not None:
        out.setdefault("cpp.simdlen", width)
    return out


def any_row_sizes(model: torch.nn.Module, max_rows: int) -> list[int]:
    """Row counts whose any-row graphs cover every count from 2 to max_rows: both sides of
    each packed linear's ``packed_max_rows`` (the forward's only branch on rows), 2
    and max_rows."""
    edges = {m.packed_max_rows for m in model.modules() if hasattr(m, "packed_max_rows")}
    sizes = {2, max_rows} | {n for p in edges for n in (p, p + 1)}
    return sorted(n for n in sizes if 2 <= n <= max_rows)


def _rows_symbolic(compiled: Callable) -> Callable:
    """``compiled`` with dim 0 of every tensor it is given (the step's rows) symbolic."""
    def run(*args):
        for a in tree_leaves(args):
            if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)
    return run


def _own_copy(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: dynamo keeps compiled entries on the code
    object, so each model's copy keeps its own graphs."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def _model_guards(entries: list) -> list[bool]:
    """guard_filter_fn for ``decode_graph``: keep every guard but those on the model (its
    first argument, ``model``): its modules' types, hooks, constants and weights (module
    docstring)."""
    return [not e.name.startswith(("model.", "model[")) for e in entries]


def failure(what: str, e: Exception) -> str:
    """"``what`` failed" with the exception's type and the first line of its message (300
    characters at most): a fallback's reason, as logs and /health show it."""
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{what} failed: {type(e).__name__}: {first}"


def _slower(compiled: float, eager: float) -> bool:
    """The compiled step lost: its bucket runs eagerly."""
    return compiled > eager * SLOWER_MARGIN


class CompiledDecode:
    """The compiled segments, the buckets they were built for, and what went wrong if
    anything did (``disabled``: None while compiled steps run)."""

    def __init__(self, model: CausalLM, device: torch.device, max_rows: int,
                 options: dict | None = None, any_rows: int | None = None,
                 graph_rows: int = 0, graph_layers: int = 0) -> None:
        """max_rows: the largest decode bucket; any_rows: the most rows a step with a
        prefill has (the token budget), or None: no any-row segments; graph_rows: buckets
        up to this many rows run as one graph (0: none); graph_layers: larger buckets run
        as graphs of this many layers each (0: per layer). The caller knows whether the
        step's attention can run in a graph (module docstring)."""
        import torch._dynamo

        self.model = model
        self.buckets = decode_buckets(max_rows)
        self.any_rows: Segments | None = None
        """The any-row segments (module docstring), None where steps with a prefill run
        eagerly: on CUDA, with LoRA, or after ``fail_any_rows``."""
        self.any_slower = False
        """The any-row segments timed clearly slower than eager at start-up: steps with a
        prefill run eagerly (kept apart from ``any_rows``, as ``slower`` is from the
        buckets, so a test can take the compiled path whatever the host's timing said)."""
        self.any_sizes = (any_row_sizes(model, any_rows)
                          if any_rows is not None and device.type == "cpu" else [])
        self.any_failed: str | None = None
        """Why the any-row segments were dropped after a failure (a fallback)."""
        self.step: Callable | None = None
        """``decode_graph`` compiled (module docstring), None where no bucket runs as graphs:
        graph_rows and graph_layers 0, on CUDA, or after ``fail_graph``."""
        self.graph_rows = graph_rows
        self.graph_layers = graph_layers
        self.num_layers = len(model.model.layers) if graph_rows or graph_layers else 0
        self.graph_failed: str | None = None
        """Why one-graph steps were dropped after a failure (a fallback)."""
        # one compiled graph per (segment, bucket) and per (layer group, bucket); dynamo's
        # default limit is 8
        groups = -(-self.num_layers // graph_layers) if graph_layers else 1
        entries = (4 + groups) * len(self.buckets)
        torch._dynamo.config.cache_size_limit = max(64, entries)
        torch._dynamo.config.accumulated_cache_size_limit = max(256, entries)
        self.device = device
        self.disabled: str | None = None
        self.compile_seconds = 0.0
        self.slower: set[int] = set()
        """Buckets whose compiled step measured clearly slower than the eager one at
        start-up (they run eagerly)."""
        self.timings: dict[int, tuple[float, float]] = {}
        """bucket -> (compiled ms, eager ms) of a dummy step, measured at start-up."""
        blocker = compile_blocker(model)
        if blocker is not None:  # a declared property of the model, not a failure
            self.segments, self.disabled = Segments(), blocker
            progress.info("not compiling the decode step (%s); decode steps run eagerly",
                          blocker)
            return
        try:
            self._wrap(options)
        except Exception as e:  # e.g. an unknown inductor option
            self.segments = Segments()
            self.fail(failure("torch.compile of the decode step", e))

    def _wrap(self, options: dict | None) -> None:
        """torch.compile the segments, the one-graph step and the any-row segments (each
        compiles on its first call: ``warm_up``)."""
        kw: dict = {"dynamic": False, "fullgraph": True}
        if self.device.type == "cuda":
            kw["mode"] = "reduce-overhead"  # CUDA graphs per bucket
        else:
            kw["options"] = cpu_options(options)
        self.segments = Segments(*(torch.compile(f, **kw)
                                   for f in (first_segment, middle_segment, last_segment)))
        if (self.graph_rows or self.graph_layers) and self.device.type == "cpu":
            self.step = torch.compile(_own_copy(decode_graph), **{
                **kw, "options": {**kw["options"], "guard_filter_fn": _model_guards}})
        if self.any_sizes:
            self.any_rows = Segments(*(_rows_symbolic(torch.compile(
                f, dynamic=None, fullgraph=True, options=kw["options"]))
                for f in (first_segment, middle_segment, last_segment)))

    def bucket(self, n: int) -> int | None:
        """The compiled bucket for n rows, or None (run eagerly): none is big enough, or the
        smallest big enough measured slower than eager at start-up."""
        if self.disabled is not None:
            return None
        b = next((b for b in self.buckets if b >= n), None)
        return b if b is not None and b not in self.slower else None

    def layer_groups(self, bucket: int) -> list[tuple[int, int]] | None:
        """The layer groups (lo, hi) a bucket's step runs as graphs of ``step``, in order:
        one group of every layer up to ``graph_rows`` rows, groups of ``graph_layers``
        above; or None: the bucket runs the segments."""
        if self.step is None:
            return None
        if bucket <= self.graph_rows:
            return [(0, self.num_layers)]
        if self.graph_layers:
            return [(lo, min(lo + self.graph_layers, self.num_layers))
                    for lo in range(0, self.num_layers, self.graph_layers)]
        return None

    def fail_graph(self, bucket: int, e: Exception) -> None:
        """A graph step (one graph, or a group of layers) failed: decode steps run the
        segments from now on."""
        self.step = None
        self.graph_failed = failure(f"one-graph decode step for batch {bucket}", e)
        log.error("%s; decode steps run per layer from now on (--compile-graph-max-batch 0 "
                  "and --compile-graph-layers 0 turn graph steps off)", self.graph_failed)

    def any_rows_for(self, n: int, decode_only: bool) -> Segments | None:
        """The any-row segments for a step of n rows that no bucket takes (a prefill, or
        more decode rows than the largest bucket), or None: run it eagerly."""
        if (self.disabled is not None or self.any_rows is None or self.any_slower or n < 2
                or (decode_only and n <= self.buckets[-1])):
            return None
        return self.any_rows

    def fail_any_rows(self, rows: int, e: Exception) -> None:
        """A step needed an any-row graph not compiled at start-up (or it failed): steps
        with a prefill run eagerly from now on."""
        self.any_rows = None
        self.any_failed = failure(f"compiled step for {rows} rows (a prefill)", e)
        log.error("%s; steps with a prefill run eagerly from now on (--no-compile turns "
                  "compilation off)", self.any_failed)

    def pad(self, ids: list[int], pos: list[int], bucket: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
        extra = bucket - len(ids)
        return (torch.tensor(ids + [0] * extra, device=self.device),
                torch.tensor(pos + [0] * extra, device=self.device))

    def warm_up(self, run_bucket: Callable[[int, Segments], None],
                run_rows: Callable[[int, Segments], None] | None = None) -> None:
        """Compile every bucket now (``run_bucket(b, segments)`` runs one dummy step of b
        rows), printing a progress line per bucket, then time it against the eager step
        (best of 3 each, in turn; a "slower" timed again) and keep the compiled one
        unless it is clearly slower (``SLOWER_MARGIN``). A failure disables compiled steps,
        logged. ``run_rows`` (default ``run_bucket``) runs one dummy step of n rows
        without the LM head, for the any-row segments."""
        t0 = time.perf_counter()
        if self.disabled is None:
            progress.info("compiling the decode step for batch sizes %s (inductor caches the "
                          "code in %s, so a restart is faster; --no-compile skips this)",
                          ",".join(map(str, self.buckets)), inductor_cache_dir())
        for i, b in enumerate(self.buckets if self.disabled is None else ()):
            t = time.perf_counter()
            try:
                run_bucket(b, self.segments)
            except Exception as e:  # inductor/dynamo raise many types; all mean "no compile"
                self.fail(failure(f"compiling the decode step for batch {b}", e))
                return
            compiled, eager = (t * 1e3 for t in best_pair(
                lambda: run_bucket(b, self.segments), lambda: run_bucket(b, EAGER),
                retry_if=_slower))
            self.timings[b] = (compiled, eager)
            slower = _slower(compiled, eager)
            if slower:
                self.slower.add(b)
            progress.info("compiled decode step %d/%d (batch %d%s) in %.1fs: "
                          "%.1f ms vs %.1f ms eager%s", i + 1, len(self.buckets), b,
                          self._graph_words(b),
                          time.perf_counter() - t, compiled, eager,
                          " (slower: this batch runs eagerly)" if slower else "")
        if self.any_rows is not None and self.disabled is None:
            self._warm_any_rows(run_rows or run_bucket)
        self.compile_seconds = time.perf_counter() - t0
        progress.info("compiled decode steps for batches %s%s in %.1fs",
                      ",".join(map(str, self.buckets)),
                      " and prefill steps" if self.any_rows is not None and not self.any_slower
                      else "",
                      self.compile_seconds)

    def _graph_words(self, bucket: int) -> str:
        """How a bucket's step runs, for its progress line: "" (per layer)."""
        groups = self.layer_groups(bucket)
        if not groups:
            return ""
        return ", one graph" if len(groups) == 1 else f", {len(groups)} graphs of layers"

    def _warm_any_rows(self, run_rows: Callable[[int, Segments], None]) -> None:
        """Compile the any-row graphs (one dummy step per size of ``any_sizes``), then
        time the largest against the eager step; kept unless clearly slower."""
        t = time.perf_counter()
        progress.info("compiling the prefill step for any row count (graphs at %s rows)",
                      ",".join(map(str, self.any_sizes)))
        try:
            for n in self.any_sizes:
                run_rows(n, self.any_rows)
        except Exception as e:  # inductor/dynamo raise many types; all mean "eager"
            self.fail_any_rows(n, e)
            return
        big = self.any_sizes[-1]
        compiled, eager = (x * 1e3 for x in best_pair(
            lambda: run_rows(big, self.any_rows), lambda: run_rows(big, EAGER),
            retry_if=_slower))
        slower = _slower(compiled, eager)
        progress.info("compiled prefill step in %.1fs: %.1f ms vs %.1f ms eager at %d rows%s",
                      time.perf_counter() - t, compiled, eager, big,
                      " (slower: steps with a prefill run eagerly)" if slower else "")
        self.any_slower = slower

    def fail(self, reason: str) -> None:
        self.disabled = reason
        log.error("%s; decode steps run eagerly from now on (--no-compile turns compilation "
                  "off)", reason)
