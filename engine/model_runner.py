"""Owns the model weights, the KV cache tensor and the attention backend; runs
one scheduled batch as one forward pass and samples every row that needs a token
(the masks of constrained rows are built beside the forward, engine/guided/masks.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from engine.attention.base import get_backend
from engine.attention.metadata import build_metadata, decode_slots
from engine.attention.paged_decode import graph_decode_unavailable
from engine.config import EngineConfig
from engine.cpu_limit import default_threads
from core.kv import kv_format_block_bytes
from core.kv.policy import decay_per_token
from engine.kv_cache.manager import NULL_BLOCK
from engine.kv_cache.h2o import compact, keep_scores, step_scores
from engine.kv_cache.policy import cache_view
from engine.kv_cache.quant import row_width, storage_dtype
from engine.kv_cache.shift import shift_keys
from engine.loader import LoadedCheckpoint
from engine.loader.gguf_loader import raw_rows
from engine.compile.decode import CompiledDecode, failure
from engine.lora.slots import LoRASlots, lora_rows, warm_rows
from engine.lora.layers import target_map
from engine.models.base import (CausalLM, ForwardContext, Segments, StepInterrupted, materialize,
                                meta_skeleton)
from engine.quant.apply import (QuantReport, kernel_fallbacks, quantize_model, select_paths,
                                unquantizable)
from engine.quant.base import resolve_method
from engine.models import MODELS
from engine.parallel.plan import StepInputs
from engine.request import Request
from engine.sampling import Sampler, TokenLogprobs, token_logprobs
from engine.spec.verify import verify

log = logging.getLogger(__name__)


@dataclass
class StepTokens:
    """What a forward pass produced: per sampled request, its new tokens (one, or the
    accepted guesses plus one for a speculating row) and their logprobs."""

    requests: list[Request]
    tokens: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]
    prompt_logprobs: list[tuple[Request, list[TokenLogprobs]]] = field(default_factory=list)
    """Per request that asked: the logprobs of the prompt tokens this step's positions
    predict, in order, continuing Request.prompt_logprobs."""


_PROMPT_LOGITS_ROWS = 256
"""Prompt positions whose logits are computed at once (bounds that tensor's memory)."""


def prompt_chunks(owed: list[tuple[Request, int, range]]) -> list[tuple[int, int]]:
    """The row ranges [start, stop) the LM head runs on for prompt logprobs, in order:
    each owed request's rows, at most _PROMPT_LOGITS_ROWS at a time."""
    return [(lo, min(lo + _PROMPT_LOGITS_ROWS, rows.stop))
            for _, _, rows in owed for lo in range(rows.start, rows.stop, _PROMPT_LOGITS_ROWS)]


@dataclass
class _Layout:
    """One step's entries as the forward takes them: token ids and positions, each
    query's length, context length and block table; the rows sampled (the last
    position, or 1 + k for a speculating row) and the prompt rows owed logprobs."""

    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    qlens: list[int] = field(default_factory=list)
    slens: list[int] = field(default_factory=list)
    qtables: list[list[int]] = field(default_factory=list)
    rows: list[range] = field(default_factory=list)
    sampled: list[Request] = field(default_factory=list)
    owed: list[tuple[Request, int, range]] = field(default_factory=list)
    """(request, first position, its rows): prompt positions whose logprobs are owed."""
    scored: list[tuple[Request, int, int]] = field(default_factory=list)
    """(request, sequence index, new tokens) of rows whose attention scores are kept (h2o)."""

    @classmethod
    def of(cls, entries: list[tuple[Request, int]], tables: list[list[int]],
           block_size: int) -> _Layout:
        lay = cls()
        for (req, n), table in zip(entries, tables):
            start = req.num_computed_tokens
            lay.ids.extend(req.token_ids[start:start + n])
            lay.ids.extend(req.draft)
            # a bounded policy: attention reads held blocks only, at positions among them
            table, lost = cache_view(req.kv_policy, table, NULL_BLOCK, block_size, start)
            lay.pos.extend(range(start - lost, start - lost + n))
            if req.draft:
                lay.qlens.extend([1] * n)
                lay.slens.extend(range(start + 1, start + n + 1))
                lay.qtables.extend([table] * n)
                lay.rows.append(range(len(lay.ids) - n, len(lay.ids)))
                lay.sampled.append(req)
                continue
            if req.kv_policy is not None and req.kv_policy.scored:
                lay.scored.append((req, len(lay.qlens), n))
            lay.qlens.append(n)
            lay.slens.append(start - lost + n)
            lay.qtables.append(table)
            owed = req.prompt_logprobs_owed
            if owed is not None:  # positions [lo, hi) predict prompt tokens still owed
                lo, hi = max(start, owed), min(start + n, req.num_prompt_tokens - 1)
                if lo < hi:
                    row0 = len(lay.ids) - n - start
                    lay.owed.append((req, lo, range(row0 + lo, row0 + hi)))
            if start + n == len(req.token_ids) and req.may_generate:  # next token is due
                for r in (req, *req.forks):  # forked choices: the same row (engine/fork.py)
                    lay.rows.append(range(len(lay.ids) - 1, len(lay.ids)))
                    lay.sampled.append(r)
        return lay


class ModelRunner:
    def __init__(self, config: EngineConfig, ckpt: LoadedCheckpoint, max_model_len: int) -> None:
        self.config = config
        self.model_config = ckpt.config
        self.max_model_len = max_model_len
        self.device = torch.device(config.load.device)
        self.dtype = config.load.torch_dtype
        threads = config.load.num_threads or default_threads()
        if threads:
            torch.set_num_threads(threads)
            if not config.load.num_threads:
                log.info("torch threads %d: the container's CPU limit (--num-threads sets "
                         "them)", threads)
        t0 = time.perf_counter()
        self.backend = get_backend(config.load.attention_backend, self.device)
        self._load_decode_kernel()
        model = self._build(ckpt, max_model_len)
        self.quant = self._quantize(model, ckpt)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.prepack_fallback = self._prepack() if config.load.prepack_weights else None
        if self.quant is not None:
            select_paths(self.model, self.quant, config.quant.quant_packed_max_rows,
                         config.quant.activation_quant)
        lora = config.lora
        self.lora = (LoRASlots(self.model, self.lora_targets, lora.max_loras, lora.max_lora_rank)
                     if lora.enabled else None)
        """The resident adapters (engine/lora/); None: base model only."""
        self.kv_dtype = config.resolved_kv_cache_dtype
        self.kv_quant = config.kv_quant
        self.num_blocks = self._num_blocks()
        self.kv = self._allocate_kv(ckpt)
        self.num_swap_blocks = int(config.cache.swap_space * (1 << 30)) // self.block_bytes
        self.num_host_slots = self.num_swap_blocks + int(
            config.cache.kv_offload_cpu_gib * (1 << 30)) // self.block_bytes
        """The swap pool's blocks and the host KV tier's share one host tensor
        (engine/kv_cache/swap.py HostSlots)."""
        pin = self.device.type == "cuda"
        # empty, not zeros: a host slot is always written (swap-out, demotion) before it is read
        self.swap_kv = torch.empty((self.num_host_slots, *self.kv.shape[1:]), dtype=self.kv.dtype,
                                   pin_memory=pin) if self.num_host_slots else None
        self.sampler = Sampler()
        self._masks = None
        self.compiled: CompiledDecode | None = None
        self.table_width = -(-max_model_len // config.cache.block_size)
        """Blocks in a one-graph decode step's padded tables (``decode_slots``)."""
        if config.compilation.compile:
            self.compiled = CompiledDecode(
                self.model, self.device,
                config.compilation.compile_max_batch or config.scheduler.max_num_seqs,
                any_rows=config.scheduler.max_num_batched_tokens if self.lora is None else None,
                **self._graph_steps())
            self.compiled.warm_up(self._dummy_decode,
                                  lambda rows, segments: self._dummy_decode(rows, segments,
                                                                            logits=False))
        log.info("model loaded in %.1fs (%s, %s); attention=%s; KV pool %d blocks x %d tokens, "
                 "KV %s, %d bytes per block", time.perf_counter() - t0, self.dtype, self.device,
                 self.backend.name, self.num_blocks, config.cache.block_size, self.kv_dtype,
                 self.block_bytes)

    def _graph_steps(self) -> dict[str, int]:
        """--compile-graph-max-batch and --compile-graph-layers where decode steps can run
        as graphs here, else 0 (said in the log when a flag asked for them)."""
        c = self.config.compilation
        asked = dict(graph_rows=c.compile_graph_max_batch, graph_layers=c.compile_graph_layers)
        why = ("LoRA steps need the per-layer segments" if self.lora is not None else
               f"--attention-backend {self.backend.name} decodes per layer"
               if not self.backend.decodes_in_graph else
               graph_decode_unavailable(self.device, self.kv_quant))
        if any(asked.values()) and why:
            log.info("decode steps compile per layer, not as one graph: %s", why)
        return {k: 0 if why else v for k, v in asked.items()}

    def _build(self, ckpt: LoadedCheckpoint, max_model_len: int) -> CausalLM:
        """The family's model with the checkpoint's weights. Every layer's attention is
        checked against the backend first: a window or soft-cap the backend would not
        compute is refused before anything loads, never run wrong."""
        with meta_skeleton():
            model = MODELS.load(ckpt.config.architecture)(ckpt.config, max_model_len)
        for params in model.attention_params():
            self.backend.check(params)
        self.lora_targets = target_map(model)  # unsplit, before quantization swaps the Linears
        self._split(model, row_scales=resolve_method(self.config.quant.quantization,
                                                     ckpt.reader is not None) == "int8")
        materialize(model, self.device)  # no random init: every weight is loaded
        model.tie_weights()  # materialize gives each module its own new Parameter
        try:
            model.load_weights(ckpt.tensors)
        except ValueError as e:
            raise ValueError(f"{ckpt.path}: {e}") from e
        return model

    def _split(self, model: CausalLM, row_scales: bool) -> None:
        """A tensor-parallel rank's share of the meta skeleton (engine/parallel/runner.py);
        one device holds all of it. row_scales: the weights will be packed as int8, whose
        row-split scales come from whole rows."""

    def _allocate_kv(self, ckpt: LoadedCheckpoint) -> torch.Tensor:
        """The block-major cache [num_blocks, L, 2, B, Hkv, row] (core/kv/layout.py):
        a row is head_dim values, or head_dim int8 codes and a float16 scale when quantized."""
        cfg = ckpt.config
        kv = torch.zeros(self.num_blocks, cfg.num_layers, 2, self.config.cache.block_size,
                         self.kv_heads, row_width(self.kv_dtype, cfg.head_dim),
                         dtype=storage_dtype(self.kv_dtype, self.dtype), device=self.device)
        assert kv[0].numel() * kv.element_size() == self.block_bytes, "one block-bytes formula"
        return kv

    def _quantize(self, model: CausalLM, ckpt: LoadedCheckpoint) -> QuantReport | None:
        """Pack the linear weights per --quantization (None: dense, as loaded)."""
        method = resolve_method(self.config.quant.quantization, ckpt.reader is not None)
        refusal = unquantizable(model) if method != "none" else None
        if refusal and self.config.quant.quantization == "auto":
            log.warning("--quantization auto: %s; every weight runs on the exact "
                        "dequantization of the file (as --quantization none)", refusal)
            method = "none"
        if method == "none":
            if self.config.quant.activation_quant != "none":
                log.warning("--activation-quant %s has no effect: this checkpoint's linears "
                            "are not packed (--quantization resolves to none)",
                            self.config.quant.activation_quant)
            return None
        lookup = (raw_rows(ckpt.reader, ckpt.config, ckpt.path) if ckpt.reader is not None
                  else lambda name: None)

        def sources(path: str):
            found = [lookup(n) for n in model.checkpoint_names(path)]
            return None if any(f is None for f in found) else found

        report = quantize_model(model, method, self.dtype, sources,
                                self.config.quant.quant_group_size, strict=method != "gguf")
        kinds = sorted(set(report.packed.values()))
        log.info("quantization %s: %d linears packed (%s), %d dense fallbacks; packed weights "
                 "%.1f MB beside %.1f MB of dense weights kept for large batches",
                 method, len(report.packed), ", ".join(kinds), len(report.fallbacks),
                 report.packed_bytes / 1e6, report.dense_bytes / 1e6)
        return report

    def _prepack(self) -> str | None:
        """Prepack the dense weights for oneDNN (engine/layers/dense.py), before the packed
        kernels are timed against them. -> why not, on a CPU where it cannot (None: done,
        or a device whose GEMMs need none)."""
        from engine.layers.dense import prepack_linears

        if self.device.type != "cpu":
            return None
        count, nbytes, reason = prepack_linears(self.model)
        if reason is not None:
            log.warning("dense GEMMs run on plain weights (%s): large batches are slower",
                        reason)
            return reason
        log.info("%d linears' dense weights prepacked for oneDNN GEMMs (%.1f MB more; "
                 "--no-prepack-weights saves it)", count, nbytes / 1e6)
        return None

    def _load_decode_kernel(self) -> None:
        """Build or load the paged decode kernel now, where the CPU SDPA backend will run
        it: a first build takes 14-25 s, which belongs to start-up, not to a first step
        (nor to a metrics scrape: ``fallbacks`` never builds)."""
        if self.device.type != "cpu" or getattr(self.backend, "name", "") != "sdpa":
            return
        from engine.attention.paged_decode import kernel_unavailable

        t0 = time.perf_counter()
        reason = kernel_unavailable()  # its own warning says why, when it cannot load
        if reason is None:
            log.info("paged decode kernel loaded in %.1fs", time.perf_counter() - t0)

    def fallbacks(self) -> dict[str, list[str]]:
        """Every speed path that is not running, and why: for logs and /metrics (a gauge
        per kind, e.g. tandem:engine_fallbacks{kind="compile"} = len(reasons)).

        quantization: linears left dense; activation_quant: --activation-quant int8 not
        running (its kernel cannot run here); compile: the compiled decode step, disabled at
        start-up (the model declares it uncompilable, or compiling failed) or after a
        failed step; paged_decode: the in-place decode attention kernel;
        block_mm, int4_mm: the weight kernels (engine/quant/apply.py kernel_fallbacks);
        prepack: the dense weights' oneDNN copies (engine/layers/dense.py) on a CPU."""
        from engine.attention.paged_decode import KERNEL

        out: dict[str, list[str]] = {"quantization": list(self.quant.fallbacks) if self.quant else [],
                                     "activation_quant": list(self.quant.activation_fallbacks)
                                     if self.quant else [],
                                     "compile": [], "paged_decode": [],
                                     "prepack": [self.prepack_fallback] if self.prepack_fallback
                                     else [],
                                     **kernel_fallbacks(self.model, self.dtype, self.device)}
        if self.compiled is not None and self.compiled.disabled:
            out["compile"].append(self.compiled.disabled)
        if self.compiled is not None and self.compiled.any_failed:
            out["compile"].append(self.compiled.any_failed)
        if self.compiled is not None and self.compiled.graph_failed:
            out["compile"].append(self.compiled.graph_failed)
        if self.device.type == "cpu" and getattr(self.backend, "name", "") == "sdpa":
            reason = KERNEL.known_reason()  # loaded at start-up; never built from here
            if reason:
                out["paged_decode"].append(reason)
        return out

    @property
    def block_bytes(self) -> int:
        cfg = self.model_config
        return kv_format_block_bytes(self.kv_dtype, cfg.num_layers, self.config.cache.block_size,
                                     self.kv_heads, cfg.head_dim)

    @property
    def kv_heads(self) -> int:
        """KV heads this process's pool holds (a tensor-parallel rank holds its share)."""
        return self.model_config.num_kv_heads

    def _num_blocks(self) -> int:
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks
        return max(1, int(self.config.cache.kv_cache_memory_gib * (1 << 30)) // self.block_bytes)

    @torch.inference_mode()
    def copy_blocks(self, swap_out: list[tuple[list[int], list[int]]],
                    swap_in: list[tuple[list[int], list[int]]],
                    copies: list[tuple[int, int]] = (), draft_kv: torch.Tensor | None = None
                    ) -> int:
        """Swap-outs (device -> host) first, then the copy-on-write copies (device ->
        device, in ``draft_kv`` too when a draft model has its own cache), then
        swap-ins (host -> device): a block freed by a swap-out may be the target of a
        copy or a swap-in in the same step, and a copy's source freed meanwhile may be
        a swap-in's target. Returns the bytes copied (swaps only).

        On CUDA each block is copied straight into its slot of the pinned swap tensor
        (an async copy), and the stream is synchronised before anything on the host may
        read those slots. Gathering on the device and index-assigning the result on the
        host instead read a pinned staging tensor while its copy was still in flight."""
        nbytes = 0
        for dev, host in swap_out:
            for d, h in zip(dev, host):
                self.swap_kv[h].copy_(self.kv[d], non_blocking=True)
            nbytes += len(dev) * self.block_bytes
        if swap_out and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # host copies have landed
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            for kv in (self.kv, draft_kv) if draft_kv is not None else (self.kv,):
                kv.index_copy_(0, dst, kv.index_select(0, src))
        for host, dev in swap_in:
            for h, d in zip(host, dev):
                self.kv[d].copy_(self.swap_kv[h], non_blocking=True)
            nbytes += len(dev) * self.block_bytes
        if swap_in and self.device.type == "cuda":
            # a swapped-in request's host blocks are freed right after this call
            torch.cuda.current_stream(self.device).synchronize()
        return nbytes

    def shift_keys(self, blocks: list[int], delta: int) -> None:
        """Re-rotate these blocks' keys by delta positions (a bounded KV policy dropped
        blocks before them: KVCacheManager.on_shift)."""
        shift_keys(self.kv, self.model, blocks, delta, self.kv_quant)

    @torch.inference_mode()
    def execute(self, entries: list[tuple[Request, int]], tables: list[list[int]],
                should_stop: Callable[[], bool] | None = None) -> StepTokens:
        """Run one forward pass; return the requests that were sampled and their tokens,
        and the prompt logprobs computed (rows that asked, ``_Layout.owed``).
        should_stop is asked between layers (StepInterrupted when it says True).

        entries: (request, new tokens) with prefill-path entries (more than one token,
        no guesses) first; tables: each request's block table. A decode row with proposed
        tokens (``req.draft``) runs its last token and the k guesses (n = 1 + k) and is
        verified (engine/spec/verify.py): it may get up to k + 1 tokens. Its n positions
        reach attention as n one-token decode queries over its block table, query j
        seeing start + j + 1 tokens (all n K/V rows are written before any is read):
        causal attention through the decode kernel, which rounds as plain decoding does."""
        lay = _Layout.of(entries, tables, self.config.cache.block_size)
        num_prefills = sum(1 for n in lay.qlens if n > 1)
        if any(n > 1 for n in lay.qlens[num_prefills:]):
            raise ValueError("execute: a prefill entry after a decode or speculating row")
        inputs = StepInputs(lay.ids, lay.pos, lay.qlens, lay.slens, num_prefills, lay.qtables,
                            [i for r in lay.rows for i in r],
                            all(n == 1 or req.draft for req, n in entries))
        sampled, rows = lay.sampled, lay.rows
        plain = [i for i, r in enumerate(sampled) if not r.draft]
        masks = self._submit_masks([r.sampling for r in sampled], [r.draft for r in sampled])
        if self.lora is not None:  # one per row of ids; makes the step's adapters resident
            inputs.lora_slots = self.lora.assign([req.lora for req, n in entries for _ in range(n)])
        inputs.scored = [(seq, req.kv_policy.budget, req.kv_policy.halflife)
                         for req, seq, _ in lay.scored]
        scores = step_scores(lay.scored, self.model_config.num_layers,
                             self.model_config.num_kv_heads, self.device)
        try:
            logits, prompt = self._run(inputs, should_stop, lay.owed, scores)
            keep_scores(lay.scored, scores, dict(enumerate(lay.qtables)), self.compact_slots)
            if logits is None:
                return StepTokens([], [], [], prompt)
        finally:  # the masks are done before anything else touches their matchers
            banned = self.masks.result(masks) if masks is not None else None
        step = self._sample(sampled, rows, logits, plain, banned)
        if prompt:
            step.prompt_logprobs = prompt
        return step

    def _prompt_logprobs(self, hidden: torch.Tensor, owed: list[tuple[Request, int, range]]
                         ) -> list[tuple[Request, list[TokenLogprobs]]]:
        """The prompt logprobs owed this step: the logits of only those positions, a slice
        of rows at a time (a [rows, vocab] fp32 tensor each, ``prompt_chunks``), so a
        request that does not ask keeps the last-position-only LM head."""
        out = []
        for req, first, rows in owed:
            pos0 = first - rows.start  # a row's position is row + pos0
            found: list[TokenLogprobs] = []
            for lo, hi in prompt_chunks([(req, first, rows)]):
                logits = self.model.compute_logits(hidden[lo:hi])  # [r, V]
                targets = [req.token_ids[r + pos0 + 1] for r in range(lo, hi)]
                found += token_logprobs(logits, targets, [req.params.prompt_logprobs] * (hi - lo))
            out.append((req, found))
        return out

    def _run(self, inputs: StepInputs, should_stop: Callable[[], bool] | None = None,
             owed: list[tuple[Request, int, range]] = (),
             scores: dict[int, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor | None, list[tuple[Request, list[TokenLogprobs]]]]:
        """One forward pass over inputs -> fp32 logits [N, V] of its logit rows (None
        when it has none) and the prompt logprobs owed (``_Layout.owed``); ``scores``:
        the accumulators attention adds into (AttentionMetadata.scores). Every rank of
        a tensor-parallel group runs this on the same inputs (engine/parallel/runner.py;
        LoRA rows name slots the ranks fill alike; owed rows are rank 0's, and
        the others run the same LM-head calls from ``inputs.prompt_chunks``)."""
        meta = build_metadata(inputs.query_lens, inputs.seq_lens, inputs.num_prefills,
                              inputs.tables, self.config.cache.block_size, self.device,
                              self.kv_quant)
        meta.scores = scores or {}
        meta.score_decay = {seq: decay_per_token(h) for seq, _, h in inputs.scored if h}
        ctx = ForwardContext(self.kv, meta, self.backend, should_stop)
        # a compiled step has no scores to give: steps with scored rows run eager
        hidden = self._forward(inputs.ids, inputs.positions, ctx, inputs.decode_only,
                               inputs.lora_slots, inputs.num_layers or None,
                               compilable=not meta.scores)
        prompt = self._prompt_logprobs(hidden, owed)
        if not owed:  # another rank of a group: rank 0's LM-head calls (their collectives)
            for lo, hi in inputs.prompt_chunks:
                self.model.compute_logits(hidden[lo:hi])
        if not inputs.logit_rows:
            return None, prompt
        return self.model.compute_logits(hidden[inputs.logit_rows]), prompt

    def read_host_blocks(self, slots: list[int]) -> torch.Tensor:
        """Host slots as a block file holds them: ``[n, block bytes]`` uint8 on the CPU,
        every KV head (engine/kv_cache/tiers/tiered.py HostBlocks)."""
        return self.swap_kv.view(torch.uint8)[slots].reshape(len(slots), -1)

    def write_host_blocks(self, slots: list[int], blocks: torch.Tensor) -> None:
        """Host slots := ``blocks`` (``[n, block bytes]`` uint8, every KV head)."""
        host = self.swap_kv.view(torch.uint8)
        host[slots] = blocks.view(len(slots), *host.shape[1:])

    def compact_slots(self, table: list[int], victims: torch.Tensor, slots: int) -> None:
        """Evict h2o's victims [L, Hkv] from a full cache of ``slots`` tokens over
        ``table`` (engine/kv_cache/h2o.py compact; at TP > 1 every rank its heads)."""
        compact(self.kv, self.model, table, victims, slots, self.kv_quant)

    def raise_if_broken(self) -> None:
        """Raise when this runner can no longer run a step (a tensor-parallel group
        with a rank gone, engine/parallel/runner.py); one process cannot break so."""

    def close(self) -> None:
        """Release what outlives this object's references (a tensor-parallel group's
        other ranks, engine/parallel/runner.py); nothing in one process."""

    @property
    def masks(self):
        """The constrained rows' mask builder (engine.guided.masks.MaskBuilder), made on
        first use: an engine that never sees a constraint never loads llguidance."""
        if self._masks is None:
            from engine.guided.masks import MaskBuilder
            self._masks = MaskBuilder()
        return self._masks

    def _submit_masks(self, states: list, drafts: list[list[int]]) -> object | None:
        """Masks laid out as the logits rows: one per plain row, 1 + k per speculating row."""
        if not any(s.guide is not None for s in states):
            return None  # unconstrained batches pay nothing
        return self.masks.submit([s.guide for s in states], self.model_config.vocab_size,
                                 drafts)

    def _sample(self, sampled: list[Request], rows: list[range], logits: torch.Tensor,
                plain: list[int], banned: torch.Tensor | None) -> StepTokens:
        """Plain rows in one sampler call (banned: the grammars' masks, one row per logits
        row); speculating rows verified one by one, each position under its mask."""
        starts, at = [], 0
        for r in rows:
            starts.append(at)
            at += len(r)
        tokens: list[list[int]] = [[] for _ in sampled]
        logprobs: list[list] = [[] for _ in sampled]
        if plain:
            at_rows = [starts[i] for i in plain]
            if at_rows == list(range(logits.shape[0])):  # every row, in order: no copy
                mine, mine_banned = logits, banned
            else:
                idx = torch.tensor(at_rows, device=logits.device)
                mine = logits.index_select(0, idx)
                mine_banned = banned.index_select(0, idx.cpu()) if banned is not None else None
            out = self.sampler(mine, [sampled[i].sampling for i in plain], mine_banned)
            for j, i in enumerate(plain):
                tokens[i], logprobs[i] = [out.token_ids[j]], [out.logprobs[j]]
        for i, req in enumerate(sampled):
            if req.draft:
                span = slice(starts[i], starts[i] + len(rows[i]))
                tokens[i], logprobs[i] = verify(self.sampler, logits[span], req.draft,
                                                req.sampling,
                                                banned[span] if banned is not None else None)
        return StepTokens(sampled, tokens, logprobs)

    def _forward(self, ids: list[int], pos: list[int], ctx: ForwardContext,
                 decode_only: bool, lora_slots: Sequence[int], num_layers: int | None = None,
                 compilable: bool = True) -> torch.Tensor:
        """Hidden states [T, H]: a compiled bucket for decode-only steps, the compiled
        any-row segments for steps with a prefill (or more decode rows than the largest
        bucket; CPU, no LoRA), else eager. lora_slots: each row's LoRA slot + 1 (0: the
        base model); empty: all base. num_layers: the first this many layers only (a
        self-draft pass: eager). compilable: False runs eagerly (rows owing h2o scores)."""
        c = self.compiled if compilable and num_layers is None else None
        bucket = c.bucket(len(ids)) if c is not None and decode_only else None
        if bucket is not None:
            tids, tpos = c.pad(ids, pos, bucket)
            try:
                with lora_rows(self.lora, lora_slots, bucket, compiled=True):
                    return self._bucket_hidden(tids, tpos, ctx, len(ids), c.segments)[:len(ids)]
            except StepInterrupted:
                raise
            except Exception as e:  # a recompile that failed: this step and later ones eager
                c.fail(failure(f"compiled decode step for batch {bucket}", e))
        elif c is not None and self.lora is None and (segments := c.any_rows_for(
                len(ids), decode_only)) is not None:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self.model(torch.tensor(ids, device=self.device),
                                      torch.tensor(pos, device=self.device), ctx, segments)
            except StepInterrupted:
                raise
            except Exception as e:  # a graph start-up did not compile: eager from now on
                c.fail_any_rows(len(ids), e)
        with lora_rows(self.lora, lora_slots, len(ids)):
            return self.model(torch.tensor(ids, device=self.device),
                              torch.tensor(pos, device=self.device), ctx,
                              num_layers=num_layers)

    def _bucket_hidden(self, tids: torch.Tensor, tpos: torch.Tensor, ctx: ForwardContext,
                       rows: int, segments: Segments, warm: bool = False) -> torch.Tensor:
        """Hidden states [bucket, H] of a decode-only step padded to its bucket: the graph
        steps where the bucket has them (one graph, or one per group of layers with
        ctx.should_stop asked between groups) and the step's tables fit them, else the
        segments. warm: at start-up, where the graphs may compile; later a guard that
        fails is an error (never a compile mid-serving) and so is anything a graph
        raises: decode steps run the segments from then on (``fail_graph``)."""
        c = self.compiled
        bucket = len(tids)
        groups = c.layer_groups(bucket) if segments is c.segments else None
        slots = (decode_slots(ctx.meta, bucket, self.table_width, self.device)
                 if groups else None)
        if slots is not None:
            try:
                with torch.compiler.set_stance("default" if warm else "fail_on_recompile"):
                    out = None
                    for lo, hi in groups:
                        if lo and ctx.should_stop is not None and ctx.should_stop():
                            raise StepInterrupted
                        out = c.step(self.model.model, tids, tpos, ctx.kv, slots, lo, hi, out)
                    return out
            except StepInterrupted:
                raise
            except Exception as e:  # noqa: BLE001 - dynamo/inductor raise many types
                c.fail_graph(bucket, e)
        return self.model(tids, tpos, ctx, segments, rows=rows)

    @torch.inference_mode()
    def _dummy_decode(self, rows: int, segments: Segments, logits: bool = True) -> None:
        """One decode step of ``rows`` one-token sequences in KV block 0 (start-up only:
        the pool is empty, so nothing cached is overwritten); logits: and the LM head."""
        meta = build_metadata([1] * rows, [1] * rows, 0, [[0]] * rows, self.config.cache.block_size,
                              self.device, self.kv_quant)
        ctx = ForwardContext(self.kv, meta, self.backend)
        tids, tpos = self.compiled.pad([0] * rows, [0] * rows, rows)
        if self.lora is not None:  # the variant a step with adapter rows runs
            with warm_rows(self.lora, rows):
                self.model(tids, tpos, ctx, segments, rows=rows)
        hidden = self._bucket_hidden(tids, tpos, ctx, rows, segments, warm=True)
        if logits:
            self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward_logits(self, inputs: StepInputs) -> torch.Tensor:
        """fp32 logits [N, V] of ``inputs``' logit rows from one forward pass outside the
        scheduler's steps (a draft pass, engine/spec/draft.py); at TP > 1 every rank runs it."""
        logits, _ = self._run(inputs)
        return logits

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], table: list[int]) -> torch.Tensor:
        """fp32 logits at every position of a prompt (for correctness tests)."""
        n = len(token_ids)
        return self.forward_logits(StepInputs(list(token_ids), list(range(n)), [n], [n],
                                              1 if n > 1 else 0, [table], list(range(n)),
                                              False))
