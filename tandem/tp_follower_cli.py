"""`tandem tp-follower`: the ranks of a tensor-parallel group that run on another node
(pod) than rank 0's, as a LeaderWorkerSet's worker pods run them: they join rank 0's
store at --tp-rendezvous (rank 0 is a `tandem prefill|decode` or `tandem generate`
with the same --tp-rendezvous) and run its steps until it ends the group."""
from __future__ import annotations

import argparse
import os
import subprocess
import time

from engine.config import parse_rendezvous

LWS_GROUP_SIZE = "LWS_GROUP_SIZE"
"""Pods in a LeaderWorkerSet group (the leader included): checked against the flags."""


def add_tp_follower_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp-rendezvous", required=True, metavar="HOST:PORT",
                   help="rank 0's store, as rank 0's --tp-rendezvous names it "
                        "(in a LeaderWorkerSet: $(LWS_LEADER_ADDRESS):PORT)")
    p.add_argument("--tensor-parallel-size", type=int, required=True,
                   help="ranks in the whole group (rank 0's --tensor-parallel-size)")
    p.add_argument("--tp-node-index", type=int, required=True,
                   help="this node's index in the group, >= 1 (node 0 is rank 0's; in a "
                        "LeaderWorkerSet: $(LWS_WORKER_INDEX))")
    p.add_argument("--tp-ranks-per-node", type=int, default=1,
                   help="ranks this node runs, one process each: node i runs ranks "
                        "i*K..i*K+K-1 (default: 1)")
    p.add_argument("--tp-join-timeout-s", type=float, default=300.0,
                   help="seconds to keep trying to reach rank 0's store (default: 300)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default: cpu)")


def node_ranks(args: argparse.Namespace) -> list[int]:
    """The ranks this node runs; a ValueError naming the flags and numbers otherwise."""
    world, per, node = args.tensor_parallel_size, args.tp_ranks_per_node, args.tp_node_index
    if world < 2:
        raise ValueError(f"--tensor-parallel-size must be >= 2 for a follower, got {world}")
    if per < 1 or world % per:
        raise ValueError(f"--tp-ranks-per-node {per} must be >= 1 and divide "
                         f"--tensor-parallel-size {world}")
    if node < 1:
        raise ValueError(f"--tp-node-index must be >= 1 (node 0 runs rank 0: `tandem "
                         f"prefill|decode --tp-rendezvous ...`), got {node}")
    if (node + 1) * per > world:
        raise ValueError(f"--tp-node-index {node} with --tp-ranks-per-node {per} runs ranks "
                         f"{node * per}..{node * per + per - 1}, beyond --tensor-parallel-size "
                         f"{world} (ranks 0..{world - 1})")
    pods = os.environ.get(LWS_GROUP_SIZE)
    if pods and int(pods) * per != world:
        raise ValueError(f"{LWS_GROUP_SIZE} {pods} pods x --tp-ranks-per-node {per} = "
                         f"{int(pods) * per} ranks, but --tensor-parallel-size is {world}")
    if args.tp_join_timeout_s <= 0:
        raise ValueError(f"--tp-join-timeout-s must be > 0, got {args.tp_join_timeout_s}")
    return list(range(node * per, node * per + per))


def run_tp_follower(args: argparse.Namespace) -> int:
    from engine.parallel.channel import external_follower_command, follower_env
    from engine.parallel.follower import follower_main

    host, port = parse_rendezvous(args.tp_rendezvous, "--tp-rendezvous")
    ranks = node_ranks(args)
    world, timeout = args.tensor_parallel_size, args.tp_join_timeout_s
    if len(ranks) == 1:  # the rank runs in this process
        follower_main(ranks[0], world, port, args.device, 0, host, timeout)
        return 0
    procs = [subprocess.Popen(external_follower_command(r, world, host, port, args.device,
                                                        timeout, os.getpid()),
                              env=follower_env(r - ranks[0])) for r in ranks]
    try:
        while True:  # one rank ending ends this node's others: the group fails as one
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return max(codes)
            if any(c for c in codes if c is not None):
                return next(c for c in codes if c)
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
