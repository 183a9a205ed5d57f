"""Each protocol state that crosses a link has a proto enum and a Python enum, and the
two agree: every Python member maps to its own proto value and back, every proto value
but UNSPECIFIED (0: none, or no answer) maps to a member. The members' values are the
strings that metrics labels, span attributes and logs carried before the enums, so
dashboards read the same series."""
from __future__ import annotations

import pytest

from core.states import FallbackReason, PreemptionMode
from proto.convert import FALLBACK, WireEnum
from kvtransfer.lease import ReleaseReason
from kvtransfer.link import RELEASE
from proto import decode_pb2, kv_link_pb2
from router.trace import Failover, RequestPath

PAIRS = [(FALLBACK, FallbackReason, decode_pb2.FallbackReason),
         (RELEASE, ReleaseReason, kv_link_pb2.ReleaseReason)]


@pytest.mark.parametrize("pair,members,wire", PAIRS, ids=["fallback", "release"])
def test_every_member_maps_both_ways(pair: WireEnum, members, wire) -> None:
    values = set()
    for m in members:
        v = pair.to_proto(m)
        assert v != 0 and pair.from_proto(v) is m, m
        values.add(v)
    assert values == set(wire.values()) - {0}  # no proto value without a member
    assert pair.to_proto(None) == 0 and pair.from_proto(0) is None
    assert pair.from_proto(max(wire.values()) + 1) is None  # a newer peer's: no answer


def test_a_member_without_a_proto_twin_fails_at_once() -> None:
    with pytest.raises(ValueError):
        WireEnum(PreemptionMode, decode_pb2.FallbackReason, "FALLBACK_")


@pytest.mark.parametrize("members,values", [
    (FallbackReason, {"lease_expired", "peer_unreachable", "transfer_failed", "unknown_peer",
                      "unauthenticated_peer"}),
    (ReleaseReason, {"released", "duplicate", "expired", "epoch_mismatch", "unknown",
                     "unauthorized"}),
    (PreemptionMode, {"swap", "recompute"}),
    (RequestPath, {"disaggregated", "local_prefill"}),
    (Failover, {"prefill_failover", "decode_failover"}),
])
def test_label_values_are_the_strings_dashboards_read(members, values) -> None:
    assert {m.value for m in members} == values
