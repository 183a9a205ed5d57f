"""How the host tier and the swap pool share host memory (engine/kv_cache/swap.py
HostSlots): the tier fills any free slot, swapping reclaims the tier's least recently
used blocks first and is never refused for the tier's sake, the tier never takes a
slot the swap pool holds; and preemption with swap stays exact with a tier beside it.
The disk tier's writer: a full queue drops and counts, never blocks; the byte budget
evicts the least recently used file; writes leave no temporary files."""
from __future__ import annotations

import threading

import pytest

from core.kv.block_hash import BlockHash
from engine.kv_cache.swap import HostSlots, SwapPool
from engine.kv_cache.tiers.block_file import KVFormat, encode
from engine.kv_cache.tiers.disk import DiskTier
from engine.kv_cache.tiers.host import HostTier
from tests.engine.test_preemption import _engine, _run_tracking_priorities, unconstrained  # noqa: F401


def _h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def test_swap_reclaims_the_tiers_oldest_slots_and_the_tier_never_takes_the_swap_pools() -> None:
    slots = HostSlots(6)
    evicted: list[BlockHash] = []
    tier = HostTier(slots, lambda h, e: evicted.append(h))
    swap = SwapPool(4, slots)
    for i in range(6):  # the tier fills the idle swap space too
        assert tier.reserve(_h(i), (i,)) is not None
    assert tier.get(_h(0), (0,)) is not None  # block 0 is now the most recently used
    assert swap.num_free == 4
    host = swap.allocate("r", 3)
    assert len(host) == 3 and evicted == [_h(1), _h(2), _h(3)]  # least recently used first
    assert tier.reserve(_h(9), (9,)) is not None  # the tier makes room among its own
    assert evicted[3:] == [_h(4)] and len(tier) == 3
    assert set(host).isdisjoint(e.slot for e in tier.entries.values())
    tier.entries[_h(0)].pins = 1  # a promotion reads it this step: not reclaimable
    assert swap.num_free == 1 and swap.allocate("s", 2) is None
    tier.entries[_h(0)].pins = 0
    swap.free("r")
    assert slots.num_free == 0 and slots.num_settling == 3  # read by this step's swap-in
    slots.settle()
    assert slots.num_free == 3
    swap.leak_check()


def test_preemption_by_swap_stays_exact_with_a_host_tier_sharing_the_memory(
        tiny_model_dir, unconstrained) -> None:  # noqa: F811
    eng = _engine(tiny_model_dir, num_kv_blocks=16, preemption_mode="swap", swap_space=0.01,
                  kv_offload_cpu_gib=0.001)
    assert _run_tracking_priorities(eng) == unconstrained
    assert eng.stats.swap_out_bytes > 0 and eng.tiers.stats.demoted > 0
    eng.leak_check()


FMT = KVFormat("fp", "float32", "float32", (1, 2, 4, 1, 8), "none")


def _disk(tmp_path, budget_files: int, queue_blocks: int = 64) -> DiskTier:
    size = len(encode(FMT, _h(0), (1, 2, 3, 4), bytes(FMT.block_bytes)))
    return DiskTier(tmp_path, budget_files * size, FMT, queue_blocks)


def test_a_full_write_queue_drops_and_counts_without_blocking(tmp_path, monkeypatch) -> None:
    disk = _disk(tmp_path, 8, queue_blocks=1)
    gate, writing = threading.Event(), threading.Event()
    real = disk._write

    def slow_write(*args) -> None:
        writing.set()
        assert gate.wait(60)
        real(*args)

    monkeypatch.setattr(disk, "_write", slow_write)
    payload = bytes(FMT.block_bytes)
    assert disk.put(_h(1), (1, 2, 3, 4), payload)
    assert writing.wait(60)  # the writer holds block 1
    assert disk.put(_h(2), (1, 2, 3, 4), payload)  # queued
    assert not disk.put(_h(3), (1, 2, 3, 4), payload)  # full: dropped, returned at once
    assert disk.read(_h(2), (1, 2, 3, 4)) == payload  # served while waiting to be written
    gate.set()
    disk.close()
    assert (disk.stats.written, disk.stats.dropped) == (2, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        disk.path(_h(i)).name for i in (1, 2))  # no temporary file left


def test_the_byte_budget_evicts_the_least_recently_used_file(tmp_path) -> None:
    disk = _disk(tmp_path, 2)
    payload = bytes(range(256)) * (FMT.block_bytes // 256)
    for i in (1, 2):
        disk.put(_h(i), (1, 2, 3, 4), payload)
        disk.drain()
    assert disk.read(_h(1), (1, 2, 3, 4)) == payload  # 1 is now the most recently used
    disk.put(_h(3), (1, 2, 3, 4), payload)
    disk.close()
    assert not disk.path(_h(2)).exists() and disk.stats.evicted == 1
    restarted = DiskTier(tmp_path, disk.budget, FMT)
    assert list(restarted.index) == [_h(1), _h(3)]
    assert restarted.read(_h(3), (1, 2, 3, 4)) == payload
    assert restarted.read(_h(3), (9, 9, 9, 9)) is None  # other tokens: not this block
    restarted.close()


def test_an_unwritable_directory_names_the_flag(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--kv-offload-dir"):
        DiskTier(blocker / "kv", 1 << 20, FMT)


def test_bad_offload_flags_name_the_flag() -> None:
    from engine.config import CacheConfig

    with pytest.raises(ValueError, match="--kv-offload-dir needs --kv-offload-cpu-gib"):
        CacheConfig(kv_offload_dir="/tmp/x")
    with pytest.raises(ValueError, match="--kv-offload-cpu-gib"):
        CacheConfig(kv_offload_cpu_gib=-1)
    with pytest.raises(ValueError, match="more host memory than this machine has"):
        CacheConfig(kv_offload_cpu_gib=1 << 20)
    with pytest.raises(ValueError, match="--kv-offload-disk-gib"):
        CacheConfig(kv_offload_disk_gib=0)


def test_a_full_disk_drops_counts_and_leaves_no_partial_file(tmp_path, monkeypatch) -> None:
    """A write that fails (ENOSPC) drops that block, counts it (write_errors, which the
    worker exports as tandem's lost-blocks metric) and leaves no temporary file; the
    next write goes on."""
    import errno

    import engine.kv_cache.tiers.disk as disk_mod

    disk = _disk(tmp_path, 8)
    real_replace, fail = disk_mod.os.replace, [True]

    def replace(src, dst) -> None:
        if fail.pop() if fail else False:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(disk_mod.os, "replace", replace)
    payload = bytes(FMT.block_bytes)
    assert disk.put(_h(1), (1, 2, 3, 4), payload)
    disk.drain()
    assert disk.read(_h(1), (1, 2, 3, 4)) is None
    assert disk.put(_h(2), (1, 2, 3, 4), payload)
    disk.close()
    assert (disk.stats.write_errors, disk.stats.written) == (1, 1)
    assert [p.name for p in tmp_path.iterdir()] == [disk.path(_h(2)).name]
