"""The contract types of kvtransfer/base.py and the backend registry."""
from __future__ import annotations

import sys

import pytest
import torch

from kvtransfer.base import (CompatRecord, KVBackendUnavailable, KVCompatError, ReadPlan,
                             SourceBlocks, contiguous_runs, get_backend)
from tests.kvtransfer.utils import make_kv


def test_compat_check_names_field_and_both_values() -> None:
    local = CompatRecord.from_kv(make_kv(torch.float32, 0, block_size=16), "m")
    remote = CompatRecord.from_kv(make_kv(torch.float32, 0, block_size=32), "m")
    with pytest.raises(KVCompatError, match="block_size: local 16 != remote 32"):
        local.check(remote)
    other = CompatRecord.from_kv(make_kv(torch.bfloat16, 0), "other")
    with pytest.raises(KVCompatError) as err:
        local.check(other)
    assert "model_fingerprint: local 'm' != remote 'other'" in str(err.value)
    assert "dtype: local 'float32' != remote 'bfloat16'" in str(err.value)
    local.check(CompatRecord.from_kv(make_kv(torch.float32, 5), "m"))


def test_compat_block_bytes_and_tensor_check() -> None:
    kv = make_kv(torch.bfloat16, 0)
    compat = CompatRecord.from_kv(kv, "m")
    assert compat.block_bytes == kv[0].numel() * 2
    compat.check_tensor(kv)
    with pytest.raises(ValueError, match="contiguous"):
        compat.check_tensor(kv.transpose(0, 1))
    with pytest.raises(ValueError, match="does not match"):
        compat.check_tensor(kv.float())


def test_read_plan_validation() -> None:
    with pytest.raises(ValueError, match="no blocks"):
        ReadPlan("r", 1, (), ())
    with pytest.raises(ValueError, match="2 remote blocks but 1 local"):
        ReadPlan("r", 1, (1, 2), (3,))
    with pytest.raises(ValueError, match="negative"):
        ReadPlan("r", 1, (-1,), (3,))
    with pytest.raises(ValueError, match="twice"):
        ReadPlan("r", 1, (1, 2), (3, 3))
    plan = ReadPlan("r", 1, (1, 40), (3, 4))
    with pytest.raises(ValueError, match="remote block id 40 out of range"):
        plan.check_bounds(32, 32)
    blocks = SourceBlocks("w", "h:1", "r", 9, (5, 6, 7), 0, 48)
    assert ReadPlan.from_source(blocks, [0, 1], skip=1) == ReadPlan("r", 9, (6, 7), (0, 1))


def test_contiguous_runs() -> None:
    assert contiguous_runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]


def test_registry_errors_name_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_backend("tcp").reader.name == "tcp"
    with pytest.raises(KVBackendUnavailable, match="--kv-transfer 'rdma'.*nixl, tcp, local"):
        get_backend("rdma")  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "nixl_cu12", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "kvtransfer.nixl", raising=False)
    with pytest.raises(KVBackendUnavailable, match="--kv-transfer nixl cannot load.*nixl-cu12"):
        get_backend("nixl")
