"""Prometheus metrics of a worker, in its own registry (several workers can share
a process in tests). Names are vLLM-style with a "tandem:" prefix (docs/architecture.md, Observability)."""
from __future__ import annotations

import dataclasses

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from core.states import FallbackReason, PreemptionMode
from worker.lora import LoRAMetrics
from worker.tier_metrics import TierMetrics

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from worker.kv_events_zmq import ZmqKVEventPublisher

FALLBACK_EVERY = 500
"""Engine-loop iterations between refreshes of tandem:engine_fallbacks."""
KV_INFO_LABELS = ("kv_cache_dtype", "kv_scale_layout", "block_size")
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class WorkerMetrics:
    def __init__(self, role: str, worker_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": role, "worker": worker_id}
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, list(labels) + list(extra), registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=r)

        self.labels = labels
        self.prompt_tokens = counter("tandem:prompt_tokens", "Prompt tokens admitted")
        self.generation_tokens = counter("tandem:generation_tokens", "Tokens generated")
        self.prefix_hits = counter("tandem:prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.prefix_queries = counter("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.requests = counter("tandem:requests", "Finished requests by reason", ("finish_reason",))
        self.kv_bytes = counter("tandem:kv_transfer_bytes", "KV bytes pulled from prefill workers")
        self.kv_blocks = counter("tandem:kv_transfer_blocks", "KV blocks pulled from prefill workers")
        self.kv_fallbacks = counter("tandem:kv_transfer_fallbacks", "Prompts recomputed locally because a pull failed", ("reason",))
        self.kv_seconds = Histogram("tandem:kv_transfer_seconds", "Seconds per KV pull",
                                    list(labels), buckets=_LATENCY, registry=r)
        self.kv_usage = gauge("tandem:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.kv_block_bytes = gauge("tandem:kv_cache_block_bytes",
                                    "Bytes of one KV block, quantization scales included")
        self.kv_info = Gauge("tandem:kv_cache_info", "Always 1; the labels say how the KV cache "
                             "stores its blocks", list(labels) + list(KV_INFO_LABELS), registry=r)
        self.running = gauge("tandem:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("tandem:num_requests_waiting", "Requests queued")
        self.leases = gauge("tandem:kv_leases_active", "Prefill leases held")
        self.prompt_tokens_waiting = gauge("tandem:num_prompt_tokens_waiting",
                                           "Prompt tokens queued and not yet computed")
        self.preemptions = counter("tandem:num_preemptions", "Requests preempted, by mode",
                                   ("mode",))
        self.swap_bytes = counter("tandem:kv_swap_bytes", "KV bytes copied to/from the host "
                                  "swap pool", ("direction",))
        self.swap_seconds = counter("tandem:kv_swap_seconds", "Seconds spent copying swap blocks")
        self.preempted_seconds = counter("tandem:request_preempted_seconds",
                                         "Seconds finished requests spent preempted")
        self.interrupted_steps = counter("tandem:engine_steps_interrupted",
                                         "Steps abandoned mid-forward for a more important "
                                         "arrival")
        self.fallbacks = Gauge("tandem:engine_fallbacks", "Speed paths not running, by kind "
                               "(quantization: linears left dense; compile; paged_decode; prepack): "
                               "the number of reasons; the log says which",
                               list(labels) + ["kind"], registry=r)
        self._spec_metrics(counter)
        self.tiers = TierMetrics(r, labels)
        self.lora = LoRAMetrics(r, labels)
        self._ticks = 0
        self._last = None  # EngineStats seen at the previous refresh
        self._create_series()

    def _create_series(self) -> None:
        """Every series now, so /metrics lists each name from the start (dashboards,
        autoscalers and their tests read names before any event happened)."""
        for metric in (self.prompt_tokens, self.generation_tokens, self.prefix_hits,
                       self.prefix_queries, self.kv_bytes, self.kv_blocks, self.kv_seconds,
                       self.kv_usage, self.kv_block_bytes, self.running, self.waiting, self.leases,
                       self.prompt_tokens_waiting, self.swap_seconds, self.preempted_seconds,
                       self.interrupted_steps):
            self.labelled(metric)
        for reason in ("stop", "length", "abort", "error", "handoff"):
            self.labelled(self.requests, finish_reason=reason)
        for fallback in FallbackReason:
            self.labelled(self.kv_fallbacks, reason=fallback.value)
        for mode in PreemptionMode:
            self.labelled(self.preemptions, mode=mode.value)
        for direction in ("in", "out"):
            self.labelled(self.swap_bytes, direction=direction)
        for kind in ("quantization", "compile", "paged_decode", "prepack"):
            self.labelled(self.fallbacks, kind=kind)

    def _spec_metrics(self, counter) -> None:
        r, names = self.registry, list(self.labels) + ["proposer"]
        self.spec_drafts = counter("tandem:spec_decode_num_drafts", "Speculating rows verified "
                                   "(one per request per step)", ("proposer",))
        self.spec_proposed = counter("tandem:spec_decode_num_draft_tokens", "Tokens proposed",
                                     ("proposer",))
        self.spec_accepted = counter("tandem:spec_decode_num_accepted_tokens",
                                     "Proposed tokens the target accepted", ("proposer",))
        self.spec_emitted = counter("tandem:spec_decode_num_emitted_tokens", "Tokens verified "
                                    "rows produced (accepted ones plus the target's own)",
                                    ("proposer",))
        self.spec_rate = Gauge("tandem:spec_decode_acceptance_rate", "Accepted / proposed "
                               "tokens since start", names, registry=r)
        self.spec_length = Gauge("tandem:spec_decode_mean_accepted_length", "Tokens per "
                                 "verified row since start (1 = no guess accepted)", names,
                                 registry=r)
        self._spec_last: dict[str, tuple[int, int, int, int]] = {}

    def _count_spec(self, engine: LLMEngine) -> None:
        if engine.speculator is None:
            return
        for name, st in engine.speculator.counters.by_proposer.items():
            now = (st.verifications, st.proposed, st.accepted, st.emitted)
            last = self._spec_last.get(name, (0, 0, 0, 0))
            for metric, a, b in zip((self.spec_drafts, self.spec_proposed, self.spec_accepted,
                                     self.spec_emitted), now, last):
                if a > b or name not in self._spec_last:
                    self.labelled(metric, proposer=name).inc(a - b)
            self.labelled(self.spec_rate, proposer=name).set(st.acceptance_rate)
            self.labelled(self.spec_length, proposer=name).set(st.mean_accepted_length)
            self._spec_last[name] = now

    def labelled(self, metric, **extra):
        """metric.labels(...) with this worker's role and id filled in."""
        return metric.labels(**self.labels, **extra)

    def set_kv_cache(self, kv_cache_dtype: str, kv_scale_layout: str, block_size: int,
                     block_bytes: int) -> None:
        """How this worker's KV cache stores blocks (fixed once the engine is built)."""
        self.labelled(self.kv_info, kv_cache_dtype=kv_cache_dtype, kv_scale_layout=kv_scale_layout,
                      block_size=str(block_size)).set(1)
        self.labelled(self.kv_block_bytes).set(block_bytes)

    def count_prompt(self, prompt_tokens: int, queried_tokens: int, cached_tokens: int) -> None:
        """A prompt was admitted: queried_tokens looked up in the prefix cache, of which
        cached_tokens were hits."""
        self.labelled(self.prompt_tokens).inc(prompt_tokens)
        self.labelled(self.prefix_queries).inc(queried_tokens)
        self.labelled(self.prefix_hits).inc(cached_tokens)

    def observe_engine(self, engine: LLMEngine, active_leases: int = 0,
                       kv_events: ZmqKVEventPublisher | None = None) -> None:
        """Refresh the gauges and add the engine counters' growth (called after steps)."""
        self._count_stats(engine.stats)
        self.tiers.observe(engine, kv_events)
        self.lora.observe(engine)
        self._count_spec(engine)
        self._ticks += 1
        if self._ticks % FALLBACK_EVERY == 1:  # cheap, but not per step
            for kind, reasons in engine.runner.fallbacks().items():
                self.labelled(self.fallbacks, kind=kind).set(len(reasons))
        self.labelled(self.kv_usage).set(engine.kv.pool.usage)
        self.labelled(self.running).set(len(engine.scheduler.running))
        self.labelled(self.waiting).set(len(engine.scheduler.waiting))
        self.labelled(self.leases).set(active_leases)
        self.labelled(self.prompt_tokens_waiting).set(
            sum(len(r.token_ids) - r.num_computed_tokens for r in engine.scheduler.waiting)
            + sum(len(r.token_ids) - r.num_computed_tokens - 1 for r in engine.scheduler.running
                  if len(r.token_ids) - r.num_computed_tokens > 1))

    def _count_stats(self, st) -> None:
        last = self._last
        for mode, n in st.preemptions.items():
            grown = n - (last.preemptions.get(mode, 0) if last else 0)
            if grown:
                self.labelled(self.preemptions, mode=mode.value).inc(grown)
        pairs = ((self.labelled(self.swap_bytes, direction="out"), st.swap_out_bytes, "swap_out_bytes"),
                 (self.labelled(self.swap_bytes, direction="in"), st.swap_in_bytes, "swap_in_bytes"),
                 (self.labelled(self.swap_seconds), st.swap_seconds, "swap_seconds"),
                 (self.labelled(self.preempted_seconds), st.preempted_seconds, "preempted_seconds"),
                 (self.labelled(self.interrupted_steps), st.interrupted_steps, "interrupted_steps"))
        for metric, now, name in pairs:
            grown = now - (getattr(last, name) if last else 0)
            if grown > 0:
                metric.inc(grown)
        self._last = dataclasses.replace(st, preemptions=dict(st.preemptions))

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
