"""NIXL serving a tensor-parallel group (kvtransfer/nixl.py, kvtransfer/group_kv.py), in
one process with two ranks played by tensors: the source stages a request's blocks into
its mirror (gathering every head) before a reader READs them; a reader that is a group
READs into its mirror and scatters each rank its heads before the read is DONE. A read
aborted or closed while its scatter runs ends FAILED only once the scatter let go; a
scatter that fails ends the read FAILED naming it. The services-level handoffs (real
ranks, P 2 -> D 1, P 1 -> D 2, P 2 -> D 2) are tests/services/test_tp_handoff.py."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtransfer.base import CompatRecord, ReadPlan, TransferState, block_view
from kvtransfer.group_kv import GroupKV
from tests.kvtransfer.utils import FINGERPRINT, make_kv

pytest.importorskip("nixl_cu12")
from kvtransfer.nixl import NixlReader, NixlSource  # noqa: E402

HEAD_MAP = [(0,), (1,)]
"""Two ranks, one KV head each (the utils' tensors have 2)."""


class Ranks:
    """A group of two ranks as tensors: ``parts[r]`` holds rank r's heads of every block.
    ``gate`` (set by default) holds a scatter until set; ``fail`` makes it raise."""

    def __init__(self, full: torch.Tensor) -> None:
        self.parts = [full[..., list(h), :].contiguous() for h in HEAD_MAP]
        self.compat = CompatRecord.from_kv(self.parts[0], FINGERPRINT, head_map=HEAD_MAP)
        self.gate = threading.Event()
        self.gate.set()
        self.scattering = threading.Event()
        """Set when a scatter begins (the READ is over)."""
        self.waiting = 0
        """Scatters held by the gate now (under ``lock``)."""
        self.lock = threading.Lock()
        self.fail = False
        self.scatters = 0

    def full(self) -> torch.Tensor:
        return torch.cat(self.parts, dim=-2)

    def group(self) -> GroupKV:
        def gather(ids, then):
            blocks = block_view(self.full()[ids].contiguous()).clone()
            if then is not None:
                then(blocks)
            return blocks

        def scatter(ids, blocks):
            self.scattering.set()
            with self.lock:
                self.waiting += 1
            self.gate.wait(30)
            with self.lock:
                self.waiting -= 1
            if self.fail:
                raise RuntimeError("rank 1 is gone")
            whole = blocks.view(self.full().dtype).view(len(ids), *self.full().shape[1:])
            for part, heads in zip(self.parts, HEAD_MAP):
                part[ids] = whole[..., list(heads), :]
            self.scatters += 1

        return GroupKV(self.parts[0], self.compat, gather, scatter)


def connected(source_kv, reader_kv, compat):
    src = NixlSource()
    src.register(source_kv, compat, lambda *a: None)
    src.serve()
    rd = NixlReader()
    rd.register(reader_kv, compat)
    return src, rd, rd.connect(src.handshake_info("prefill-0"))


def read(rd, peer, remote, local):
    handle = rd.start_read(peer, ReadPlan("r", 1, remote, local, "t"))
    assert rd.wait(handle, 10) is TransferState.DONE, handle.error
    return handle


def test_a_group_source_is_read_after_staging_and_a_group_reader_scatters() -> None:
    src_ranks = Ranks(make_kv(torch.float32, seed=1))
    dst_ranks = Ranks(torch.zeros_like(make_kv(torch.float32, seed=2)))
    src, rd, peer = connected(src_ranks.group(), dst_ranks.group(), src_ranks.compat)
    try:
        assert src.stages
        src.stage([3, 4, 9])
        handle = read(rd, peer, (3, 4, 9), (0, 7, 2))
        assert handle.nbytes == 3 * src_ranks.compat.block_bytes  # every head of each block
        want = src_ranks.full()
        for part, heads in zip(dst_ranks.parts, HEAD_MAP):
            assert torch.equal(part[[0, 7, 2]], want[[3, 4, 9]][..., list(heads), :])
        assert dst_ranks.scatters == 1 and rd.in_flight() == 0
    finally:
        rd.close()
        src.close()


def test_a_one_rank_reader_reads_a_group_source_whole() -> None:
    src_ranks = Ranks(make_kv(torch.float32, seed=1))
    dst = torch.zeros_like(src_ranks.full())
    compat = CompatRecord.from_kv(dst, FINGERPRINT)
    src = NixlSource()
    src.register(src_ranks.group(), src_ranks.compat, lambda *a: None)
    src.serve()
    rd = NixlReader()
    rd.register(dst, compat)
    plain = NixlSource()
    plain.register(dst, compat, lambda *a: None)
    try:
        assert src.stages and not plain.stages  # one tensor: READs need no staging
        peer = rd.connect(src.handshake_info("prefill-0"))
        src.stage([5, 6])
        read(rd, peer, (5, 6), (1, 2))
        assert torch.equal(dst[[1, 2]], src_ranks.full()[[5, 6]])
    finally:
        plain.close()
        rd.close()
        src.close()


@pytest.mark.parametrize("how", ["abort", "fail", "close"])
def test_a_read_whose_scatter_runs_ends_only_when_it_let_go(how: str) -> None:
    """Aborted (a pull's timeout) while the scatter waits: still PENDING, since the
    ranks' blocks may be written until the scatter is over; then FAILED. A scatter that
    raises: FAILED naming it. Closed: FAILED at once (the scatter is not waited for)."""
    src_ranks = Ranks(make_kv(torch.float32, seed=1))
    dst_ranks = Ranks(torch.zeros_like(src_ranks.full()))
    dst_ranks.gate.clear()
    dst_ranks.fail = how == "fail"
    src, rd, peer = connected(src_ranks.group(), dst_ranks.group(), src_ranks.compat)
    try:
        src.stage([1])
        handle = rd.start_read(peer, ReadPlan("r", 1, (1,), (4,), "t"))
        deadline = time.monotonic() + 10
        while not dst_ranks.scattering.is_set():  # NIXL's READ is over; the scatter waits
            assert rd.poll(handle) is TransferState.PENDING and time.monotonic() < deadline
        if how == "close":
            rd.close()
            assert handle.state is TransferState.FAILED and rd.in_flight() == 0
            dst_ranks.gate.set()
            return
        if how == "abort":
            rd.abort(handle)
        assert rd.poll(handle) is TransferState.PENDING and rd.in_flight() == 1
        dst_ranks.gate.set()
        state = rd.wait(handle, 10)
        assert state is TransferState.FAILED and rd.in_flight() == 0
        assert str(handle.error) == ("read aborted" if how == "abort" else
                                     "the group's scatter of 1 blocks failed: "
                                     "RuntimeError('rank 1 is gone')")
    finally:
        dst_ranks.gate.set()
        rd.close()
        src.close()


def test_several_pulls_scatter_at_once() -> None:
    """A scatter waits for the engine thread's next step boundary; two pulls' scatters
    wait side by side (not one per boundary): both are held by the gate together."""
    src_ranks = Ranks(make_kv(torch.float32, seed=1))
    dst_ranks = Ranks(torch.zeros_like(src_ranks.full()))
    dst_ranks.gate.clear()
    src, rd, peer = connected(src_ranks.group(), dst_ranks.group(), src_ranks.compat)
    try:
        src.stage([1, 2])
        handles = [rd.start_read(peer, ReadPlan(f"r{i}", 1, (i + 1,), (i + 4,), "t"))
                   for i in range(2)]
        deadline = time.monotonic() + 10
        while dst_ranks.waiting < 2:
            for h in handles:
                assert rd.poll(h) is TransferState.PENDING
            assert time.monotonic() < deadline, f"{dst_ranks.waiting} scatter(s) at once"
            time.sleep(0.001)
        dst_ranks.gate.set()
        assert [rd.wait(h, 10) for h in handles] == [TransferState.DONE] * 2
        assert dst_ranks.scatters == 2 and rd.in_flight() == 0
    finally:
        dst_ranks.gate.set()
        rd.close()
        src.close()
