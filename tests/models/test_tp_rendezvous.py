"""A tensor-parallel group whose ranks are started from outside (--tp-rendezvous, as
a LeaderWorkerSet's pods start them): this process is rank 0 and starts no rank; rank 1
is a separately started `tandem tp-follower` that joins rank 0's store on 127.0.0.1.
Greedy tokens equal TP 1's; killing the follower (no process handle: its heartbeat is
all rank 0 sees) fails the group within seconds; a follower leaves once rank 0 ends the
group; an unreachable rendezvous and a size mismatch are errors naming the flag, the
address and the numbers. One group serves the token check and the kill (its follower
starts once); the other groups here start no model. The module takes ~45 s on this
machine: each follower process it starts spends ~8 s importing torch, and three are
needed (a group that runs, one refused for its size, one that rank 0 ends)."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from engine.config import ParallelConfig
from engine.parallel.channel import follower_env
from engine.parallel.group import Rendezvous, TPGroup
from tests.models.test_tensor_parallel import compare

JOIN_S = 120.0
"""How long rank 0 waits for the follower: its start (importing torch) on a busy machine."""
WAIT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_follower(port: int, world: int = 2, node: int = 1, join_s: float = JOIN_S
                   ) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "tp-follower", "--tp-rendezvous",
         f"127.0.0.1:{port}", "--tensor-parallel-size", str(world), "--tp-node-index",
         str(node), "--tp-join-timeout-s", str(join_s)],
        env=follower_env(0), stderr=subprocess.PIPE, text=True)


def rank0(port: int, join_s: float = JOIN_S) -> TPGroup:
    return TPGroup(2, "cpu", Rendezvous(f"127.0.0.1:{port}", 1, join_s))


def _ended(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.fixture(scope="module")
def external():
    """Rank 0 (this process) of a group of 2 whose rank 1 was started on its own."""
    port = free_port()
    follower = start_follower(port)
    try:
        group = rank0(port)
    except BaseException:
        follower.kill()
        raise
    yield group, follower
    group.shutdown()
    _ended(follower)


def test_flags_that_cannot_make_a_group_are_refused_naming_them() -> None:
    from tandem.cli import build_parser
    from tandem.tp_follower_cli import node_ranks

    cases = [
        (dict(tensor_parallel_size=2, tp_rendezvous="nohost"), "--tp-rendezvous must be HOST:PORT"),
        (dict(tensor_parallel_size=2, tp_rendezvous="h:70000"), "--tp-rendezvous must be HOST:PORT"),
        (dict(tensor_parallel_size=1, tp_rendezvous="h:29500"), "--tp-rendezvous needs --tensor-parallel-size > 1"),
        (dict(tensor_parallel_size=4, tp_rendezvous="h:1", tp_ranks_per_node=3),
         "--tp-ranks-per-node 3 must be >= 1 and divide --tensor-parallel-size 4"),
        (dict(tensor_parallel_size=2, tp_ranks_per_node=2), "--tp-ranks-per-node needs --tp-rendezvous"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            ParallelConfig(**kw)
    assert ParallelConfig(4, "h:1", 2).ranks_per_node == 2
    assert ParallelConfig(4, "h:1").ranks_per_node == 1 and ParallelConfig(4).ranks_per_node == 4

    def ranks(*argv: str) -> list[int]:
        return node_ranks(build_parser().parse_args(["tp-follower", "--tp-rendezvous", "h:1", *argv]))

    assert ranks("--tensor-parallel-size", "8", "--tp-node-index", "1", "--tp-ranks-per-node", "4") == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="--tp-node-index 2 with --tp-ranks-per-node 2 runs ranks 4..5, "
                                         "beyond --tensor-parallel-size 4"):
        ranks("--tensor-parallel-size", "4", "--tp-node-index", "2", "--tp-ranks-per-node", "2")
    with pytest.raises(ValueError, match="--tp-node-index must be >= 1"):
        ranks("--tensor-parallel-size", "2", "--tp-node-index", "0")


def test_lws_group_size_that_does_not_match_is_refused(monkeypatch) -> None:
    from tandem.cli import build_parser
    from tandem.tp_follower_cli import node_ranks

    monkeypatch.setenv("LWS_GROUP_SIZE", "3")
    args = build_parser().parse_args(["tp-follower", "--tp-rendezvous", "h:1", "--tensor-parallel-size",
                                      "4", "--tp-node-index", "1", "--tp-ranks-per-node", "2"])
    with pytest.raises(ValueError, match="LWS_GROUP_SIZE 3 pods x --tp-ranks-per-node 2 = 6 ranks, "
                                         "but --tensor-parallel-size is 4"):
        node_ranks(args)


def test_rank0_whose_ranks_do_not_join_fails_in_bounded_time() -> None:
    port = free_port()
    t = time.monotonic()
    with pytest.raises(ValueError, match=rf"--tp-rendezvous 127.0.0.1:{port}: rank\(s\) 1 of "
                                         r"--tensor-parallel-size 2 did not join within "
                                         r"--tp-join-timeout-s 1"):
        rank0(port, join_s=1.0)
    assert time.monotonic() - t < 30
    assert not dist.is_initialized()


def test_rank0_that_cannot_listen_names_the_flag_and_port() -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"--tp-rendezvous 127.0.0.1:{port}: rank 0 cannot "
                                             rf"listen on port {port}"):
            rank0(port, join_s=1.0)
    assert not dist.is_initialized()


def test_a_follower_that_cannot_reach_the_rendezvous_names_it() -> None:
    """In this process: the follower's join, with nothing listening."""
    from engine.parallel.follower import join_external

    port = free_port()
    t = time.monotonic()
    with pytest.raises(ValueError, match=rf"--tp-rendezvous 127.0.0.1:{port}: rank 1 could not "
                                         r"reach rank 0's store within --tp-join-timeout-s 1 "):
        join_external(1, 2, "127.0.0.1", port, 1.0)
    assert time.monotonic() - t < 30


def test_a_size_mismatch_fails_both_sides_naming_the_numbers() -> None:
    port = free_port()
    follower = start_follower(port, world=4)
    want = (f"--tp-rendezvous 127.0.0.1:{port}: rank 1 was started with --tensor-parallel-size "
            f"4, but rank 0's group has 2 ranks")
    with pytest.raises(ValueError, match=want):
        rank0(port)
    code, err = _ended(follower)
    assert code == 2 and want in err, err
    assert not dist.is_initialized()


def test_a_follower_leaves_once_rank0_fails_the_group() -> None:
    port = free_port()
    follower = start_follower(port)
    group = rank0(port)
    try:
        group.fail("a test")
    finally:
        group.shutdown()
    code, err = _ended(follower)
    assert code == 1 and "rank 1: rank 0 ended the group" in err, err


def test_external_rank_gives_tp1_tokens(checkpoint, external) -> None:
    """4 prompts x 32 tokens, batched (~20 s alone, most of it building the session's
    llama checkpoint and the follower's start, which the fixture pays for)."""
    group, _ = external
    assert group.pids == [] and group.external == [1]
    compare(checkpoint("llama"), group, alone=False, count=4)


def test_killing_the_external_rank_fails_the_group_within_seconds(external, monkeypatch) -> None:
    """Rank 0 holds no process of rank 1's: its heartbeat stopping is the news (the
    hang window is cut to 2 s here to keep the test short)."""
    group, follower = external
    monkeypatch.setattr("engine.parallel.group.HANG_SECONDS", 2.0)
    follower.kill()
    t = time.monotonic()
    while group.failed is None and time.monotonic() - t < WAIT_S:
        time.sleep(0.1)
    assert group.failed == ("tensor-parallel group failed: rank 1 (started elsewhere, joined at "
                            "127.0.0.1:%d) stopped answering (no heartbeat for 2 s)"
                            % int(group.rendezvous.address.rsplit(":", 1)[1])), group.failed
    assert time.monotonic() - t < 15


def test_each_rank_of_a_node_takes_its_own_gpu(monkeypatch) -> None:
    """Whoever starts a node's ranks numbers them among the node (LOCAL_RANK) and each
    makes that GPU current before the rendezvous: every rank ran on cuda:0 before."""
    from engine.parallel import channel

    assert follower_env(3)[channel.LOCAL_RANK] == "3"
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for local in (1, 3):
        monkeypatch.setenv(channel.LOCAL_RANK, str(local))
        channel.use_local_gpu("cuda")
        channel.use_local_gpu("cpu")  # no GPU to pick
    monkeypatch.delenv(channel.LOCAL_RANK)
    channel.use_local_gpu("cuda")
    assert chosen == [1, 3, 0]
