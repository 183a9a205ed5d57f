"""Prometheus metrics of the KV tiers below the device pool (docs/kv-offload.md) and of
the vLLM-format event publisher, in a worker's registry (worker/metrics.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from worker.kv_events_zmq import ZmqKVEventPublisher

class TierMetrics:
    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.labels = labels
        names = list(labels)
        self.blocks = Gauge("tandem:kv_offload_blocks", "KV blocks held by a tier below the "
                            "device pool", names + ["tier"], registry=registry)
        self.stored = Counter("tandem:kv_offload_stored", "KV blocks copied into a tier "
                              "(host: demoted from the device; disk: files written)",
                              names + ["tier"], registry=registry)
        self.hits = Counter("tandem:kv_offload_hits", "KV blocks promoted back to the device "
                            "from a tier", names + ["tier"], registry=registry)
        self.lost = Counter("tandem:kv_offload_lost", "KV blocks a tier could not keep, by "
                            "reason (no_host_slot, disk_queue_full, disk_write_error)",
                            names + ["reason"], registry=registry)
        self.skipped = Counter("tandem:kv_offload_disk_files_skipped", "Disk tier files not "
                               "read as KV (corrupt, foreign): deleted, recomputed",
                               names + ["reason"], registry=registry)
        self.events_dropped = Counter("tandem:kv_events_dropped", "vLLM-format KV event "
                                      "batches dropped because the publisher's queue was full",
                                      names, registry=registry)
        self._last: dict[tuple[int, str], float] = {}
        for tier in ("host", "disk"):
            for metric in (self.blocks, self.stored, self.hits):
                metric.labels(**labels, tier=tier)
        for reason in ("no_host_slot", "disk_queue_full", "disk_write_error"):
            self.lost.labels(**labels, reason=reason)
        for reason in ("corrupt", "foreign"):
            self.skipped.labels(**labels, reason=reason)
        self.events_dropped.labels(**labels)

    def observe(self, engine: LLMEngine, publisher: ZmqKVEventPublisher | None) -> None:
        """Refresh from the engine's tiers and the publisher (engine thread)."""
        if publisher is not None:
            self._grow(self.events_dropped, {}, publisher.dropped)
        tiers = engine.tiers
        if tiers is None:
            return
        st, disk = tiers.stats, tiers.disk
        self.blocks.labels(**self.labels, tier="host").set(len(tiers.host))
        self._grow(self.stored, {"tier": "host"}, st.demoted)
        self._grow(self.hits, {"tier": "host"}, st.host_hits)
        self._grow(self.hits, {"tier": "disk"}, st.disk_hits)
        self._grow(self.lost, {"reason": "no_host_slot"}, st.not_demoted)
        if disk is None:
            return
        ds = disk.stats
        self.blocks.labels(**self.labels, tier="disk").set(len(disk.index))
        self._grow(self.stored, {"tier": "disk"}, ds.written)
        self._grow(self.lost, {"reason": "disk_queue_full"}, ds.dropped)
        self._grow(self.lost, {"reason": "disk_write_error"}, ds.write_errors)
        self._grow(self.skipped, {"reason": "corrupt"}, ds.corrupt)
        self._grow(self.skipped, {"reason": "foreign"}, ds.foreign)

    def _grow(self, metric: Counter, extra: dict[str, str], now: float) -> None:
        """Add a cumulative count's growth since the last refresh."""
        key = (id(metric), ",".join(f"{k}={v}" for k, v in sorted(extra.items())))
        grown = now - self._last.get(key, 0)
        if grown > 0:
            metric.labels(**self.labels, **extra).inc(grown)
            self._last[key] = now
