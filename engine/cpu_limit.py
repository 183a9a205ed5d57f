"""How many torch threads a process should run when nobody said (--num-threads).

torch's default is one thread per core the process may run on. In a container with a
CPU limit (a pod's ``resources.limits.cpu`` without the static CPU manager) that is
every core of the node, while the quota lets only ``limit`` of them run at once: the
threads of each parallel region then wait for each other's turn (on this project's
2-core host, two processes with 2 threads each took about 7.7 ms per layer whatever
the kernel). So the default is capped at the cgroup's CPU limit, rounded up.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP) -> float | None:
    """The CPU limit in cores: cgroup v2 ``cpu.max`` ("quota period"), else v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None when unlimited or unreadable."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def default_threads(root: Path = CGROUP) -> int | None:
    """Threads for torch when the limit is below the cores this process may use; None
    when torch's own default (those cores) is right."""
    limit = cgroup_cpu_limit(root)
    if limit is None or math.ceil(limit) >= len(os.sched_getaffinity(0)):
        return None
    return math.ceil(limit)
