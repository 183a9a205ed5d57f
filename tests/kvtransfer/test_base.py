"""The contract types of kvtransfer/base.py and the backend registry."""
from __future__ import annotations

import sys

import pytest
import torch

from kvtransfer.base import (CompatRecord, KVBackendUnavailable, KVCompatError, ReadPlan,
                             SourceBlocks, contiguous_runs, get_backend)
from tests.kvtransfer.utils import SHAPE, make_kv


@pytest.mark.parametrize("tp, ranks", [(2**31, (0,)), (3, (0, 1, 2, 3)), (2, (0, 1, 2))])
def test_a_peer_record_whose_group_cannot_be_split_is_refused(tp: int, ranks) -> None:
    """A Handshake's record with more ranks than rank_kv_heads entries (or not a multiple)
    describes no group. It was accepted, and the check's head map then built one entry
    per rank: 2**31 of them took a prefill worker to 23 GB (found by the gRPC fuzz)."""
    with pytest.raises(KVCompatError, match=f"rank_kv_heads: {len(ranks)} entries cannot be "
                                            f"split evenly over tensor_parallel_size {tp}"):
        CompatRecord("m", "float32", 16, 2, 4, 8, tensor_parallel_size=tp, rank_kv_heads=ranks)
    whole = CompatRecord("m", "float32", 16, 2, 4, 8, tensor_parallel_size=2,
                         rank_kv_heads=(0, 1, 2, 3))
    assert whole.head_map() == [(0, 1), (2, 3)]


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


def test_compat_names_the_head_layout_and_maps_any_tp_with_the_same_heads() -> None:
    """Rank 0 of a TP-2 group holds half the KV heads; its record names the model's
    total and each rank's heads, and is interchangeable with a TP-1 record of the same
    heads (a block on the wire carries all of them). Other total heads are refused,
    naming both layouts; the record survives the wire."""
    from kvtransfer.link import compat_from_proto, compat_to_proto

    assert SHAPE["num_kv_heads"] == 2
    full = make_kv(torch.float32, 0)
    half = full[..., :1, :].contiguous()
    one = CompatRecord.from_kv(full, "m")
    two = CompatRecord.from_kv(half, "m", head_map=[[0], [1]])
    assert (two.num_kv_heads, two.tensor_parallel_size, two.rank_kv_heads) == (2, 2, (0, 1))
    assert two.block_bytes == one.block_bytes and two.head_map() == [(0,), (1,)]
    one.check(two)
    two.check(one)
    two.check_tensor(half)
    assert compat_from_proto(compat_to_proto(two)) == two
    assert compat_from_proto(compat_to_proto(one)) == one
    fewer = CompatRecord.from_kv(half, "m")
    with pytest.raises(KVCompatError) as err:
        fewer.check(two)
    assert "num_kv_heads: local 1 != remote 2" in str(err.value)
    assert ("head layouts cannot be mapped: local 1 KV heads x head_dim "
            f"{SHAPE['head_dim']} on one rank, remote 2 KV heads x head_dim "
            f"{SHAPE['head_dim']} over TP 2 (ranks hold [0] [1])") in str(err.value)


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
