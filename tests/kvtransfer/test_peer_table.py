"""PeerTable: a reader's per-peer state is released once, and only when no read uses it."""
from __future__ import annotations

from kvtransfer.base import PeerId
from kvtransfer.peer_table import PeerTable

A = PeerId("prefill-a")


def test_a_replaced_state_is_released_after_its_last_read() -> None:
    released: list[str] = []
    table: PeerTable[str] = PeerTable(released.append)
    table.set(A, "agent-1")
    first, second = table.begin(A), table.begin(A)
    table.set(A, "agent-2")  # a re-handshake while two reads use agent-1
    assert table.get(A) == "agent-2" and released == [] and len(table) == 2
    table.end(first)
    assert released == []
    table.end(second)
    assert released == ["agent-1"] and len(table) == 1
    idle = table.begin(A)
    table.end(idle)
    table.drop(A)  # no read on agent-2: released at once
    assert released == ["agent-1", "agent-2"] and len(table) == 0 and table.get(A) is None


def test_drop_and_clear_keep_a_state_while_a_read_uses_it() -> None:
    released: list[str] = []
    table: PeerTable[str] = PeerTable(released.append)
    table.set(A, "a")
    table.set(PeerId("b"), "b")
    read = table.begin(A)
    table.clear()
    assert released == ["b"] and len(table) == 1 and table.get(A) is None
    table.drop(A)  # unknown now: a no-op
    table.end(read)
    assert released == ["b", "a"] and len(table) == 0
