"""torch's thread count without --num-threads: the cores this process may use, capped at
the container's CPU limit (a pod's limits.cpu), read from cgroup v2 or v1."""
from __future__ import annotations

import os

import pytest

from engine.cpu_limit import cgroup_cpu_limit, default_threads


def _v2(root, text: str):
    root.mkdir(exist_ok=True)
    (root / "cpu.max").write_text(text)
    return root


def _v1(root, quota: int, period: int = 100000):
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return root


def test_the_limit_is_read_from_cgroup_v2_or_v1(tmp_path) -> None:
    assert cgroup_cpu_limit(_v2(tmp_path / "a", "150000 100000\n")) == 1.5
    assert cgroup_cpu_limit(_v2(tmp_path / "b", "max 100000\n")) is None
    assert cgroup_cpu_limit(_v1(tmp_path / "c", 50000)) == 0.5
    assert cgroup_cpu_limit(_v1(tmp_path / "d", -1)) is None  # v1's "no limit"
    assert cgroup_cpu_limit(tmp_path) is None  # nothing to read: no limit known


@pytest.mark.parametrize("limit, cores, want", [
    ("50000 100000", 8, 1), ("250000 100000", 8, 3), ("800000 100000", 8, None),
    ("max 100000", 8, None), ("1600000 100000", 8, None)])
def test_threads_are_capped_at_the_limit(tmp_path, monkeypatch, limit, cores, want) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert default_threads(_v2(tmp_path, limit)) == want
