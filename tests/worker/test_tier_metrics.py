"""The KV tiers' Prometheus metrics (worker/tier_metrics.py): blocks per tier, hits by
tier, and a corrupt disk file counted once, however often the metrics refresh."""
from __future__ import annotations

from tests.engine.test_kv_tiers import (BS, PROMPT, _block_file, _run, _spilled_engine,
                                        _write_prompt_to_disk)
from worker.metrics import WorkerMetrics


def test_tier_metrics_count_hits_by_tier_and_skipped_files(flat_model_dir, tmp_path) -> None:
    _write_prompt_to_disk(flat_model_dir, tmp_path)
    eng = _spilled_engine(flat_model_dir, tmp_path)
    m = WorkerMetrics("decode", "d0")

    def value(name: str, **labels) -> float:
        return m.registry.get_sample_value(name, {**m.labels, **labels})

    m.observe_engine(eng)
    on_disk = len(eng.tiers.disk.index)
    assert on_disk >= 4 and value("tandem:kv_offload_blocks", tier="disk") == on_disk
    path = _block_file(eng, 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the digest's last byte
    path.write_bytes(bytes(data))
    assert _run(eng, PROMPT)[1] == BS  # block 0 from disk, block 1 corrupt: recomputed
    for _ in range(3):  # refreshes add growth, never the totals again
        m.observe_engine(eng)
    assert value("tandem:kv_offload_hits_total", tier="disk") == 1
    assert value("tandem:kv_offload_hits_total", tier="host") == 0
    assert value("tandem:kv_offload_disk_files_skipped_total", reason="corrupt") == 1
    assert value("tandem:kv_offload_disk_files_skipped_total", reason="foreign") == 0
    assert value("tandem:kv_offload_stored_total", tier="host") == eng.tiers.stats.demoted
    assert value("tandem:kv_events_dropped_total") == 0
    eng.close()
    eng.leak_check()
