"""Ranks 1..N-1 of a tensor-parallel group: a process that builds its shard of the
model when rank 0 says BUILD and then runs each forward rank 0 sends, until EXIT.

It holds no scheduler, no requests and no sampler: rank 0 owns those and sends only
the runner's inputs (engine/parallel/plan.py). Any error here ends the process with a
non-zero code, and rank 0's watch then fails the whole group (engine/parallel/group.py):
a rank that cannot run a step must never leave the others waiting in a collective.

A rank started elsewhere (another pod of a --tp-rendezvous group, `tandem tp-follower`)
first checks that it belongs: rank 0's group size must be its --tensor-parallel-size,
its rank within it and not taken. It has no parent of rank 0's to watch: it leaves
when rank 0's heartbeat stops for HANG_SECONDS, when rank 0's store is gone, or at
once when rank 0 marks the group failed.
"""
from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.parallel.channel import (ERROR_KEY, HOST, IDLE_TIMEOUT, STEP_TIMEOUT, STOP_KEY,
                                     WORLD_KEY, backend_for, beat_key, claim_key,
                                     config_from_tensor, exchange_errors, store_error,
                                     use_local_gpu)
from engine.parallel.group import HANG_SECONDS
from engine.parallel.plan import Copies, Op, StepInputs

log = logging.getLogger(__name__)


_leaving = threading.Event()
"""Set once rank 0 said EXIT: the store going away is then no news."""


def _heartbeat(rank: int, port: int, parent: int) -> None:
    """Move the counter rank 0 watches, on a store client of its own; end this process
    once rank 0 is gone (nothing else would wake a rank waiting for its next command)."""
    try:
        store = dist.TCPStore(HOST, port, is_master=False, timeout=STEP_TIMEOUT)
        while os.getppid() == parent:
            store.add(beat_key(rank), 1)
            time.sleep(0.5)
    except Exception:  # noqa: BLE001 - rank 0's store is gone: so is rank 0
        pass
    os._exit(1)


def _heartbeat_external(rank: int, host: str, port: int, parent: int) -> None:
    """The heartbeat of a rank started elsewhere: it also watches rank 0's (and its
    parent, where one started it) and ends this process once rank 0 is gone or hung."""
    why = "rank 0's store is gone"
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=HANG_SECONDS))
        seen, since = -1, time.monotonic()
        while not parent or os.getppid() == parent:
            store.add(beat_key(rank), 1)
            if store.check([STOP_KEY]):
                why = "rank 0 ended the group"
                break
            now = store.add(beat_key(0), 0)
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > HANG_SECONDS:
                why = f"rank 0 stopped answering (no heartbeat for {HANG_SECONDS:.0f} s)"
                break
            time.sleep(0.5)
        else:
            why = "the process that started this rank is gone"
    except Exception:  # noqa: BLE001 - rank 0's store is gone: so is rank 0
        pass
    if _leaving.is_set():
        return
    print(f"tandem tp-follower: rank {rank}: {why} ({host}:{port}); leaving", file=sys.stderr,
          flush=True)
    os._exit(1)


def join_external(rank: int, world: int, host: str, port: int, join_timeout_s: float
                  ) -> dist.TCPStore:
    """Reach rank 0's store and claim ``rank`` in its group: a ValueError naming the flag,
    the address and the numbers where this rank cannot (rank 0 is told it too)."""
    where = f"--tp-rendezvous {host}:{port}"
    try:
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=timedelta(seconds=join_timeout_s))
    except RuntimeError as e:
        raise ValueError(f"{where}: rank {rank} could not reach rank 0's store within "
                         f"--tp-join-timeout-s {join_timeout_s:g} ({store_error(e)})") from None
    theirs = int(store.get(WORLD_KEY))
    problem = None
    if theirs != world:
        problem = (f"rank {rank} was started with --tensor-parallel-size {world}, but rank 0's "
                   f"group has {theirs} ranks")
    elif not 0 < rank < world:
        problem = f"rank {rank} is not one of ranks 1..{world - 1} (--tensor-parallel-size {world})"
    elif store.add(claim_key(rank), 1) != 1:
        problem = f"rank {rank} joined twice (another process already holds it)"
    if problem:
        store.compare_set(ERROR_KEY, "", problem)  # the first problem is rank 0's error
        raise ValueError(f"{where}: {problem}")
    store.set_timeout(STEP_TIMEOUT)
    return store


def _receive(control) -> tuple[Op, torch.Tensor]:
    head = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(head, 0, group=control)
    op, n = Op(int(head[0])), int(head[1])
    body = torch.zeros(n, dtype=torch.int64)
    if n:
        dist.broadcast(body, 0, group=control)
    return op, body


def _build(rank: int, world: int, body: torch.Tensor, control):
    from engine.parallel.runner import ShardedRunner  # torch and the model code: after the rendezvous
    from engine.served_model import context_window, open_checkpoint

    runner, error = None, ""
    try:
        config = config_from_tensor(body)
        ckpt = open_checkpoint(config.load)
        runner = ShardedRunner(config, ckpt, context_window(config.load, ckpt.config), rank, world,
                               control=control)
    except Exception as e:  # noqa: BLE001 - rank 0 reports it, naming this rank
        error = f"{type(e).__name__}: {e}"
    exchange_errors(error, control)
    return runner


def follower_main(rank: int, world: int, port: int, device: str, parent: int,
                  host: str | None = None, join_timeout_s: float | None = None) -> None:
    """The process of rank ``rank``: meet the group, then serve rank 0's commands.
    ``host``: rank 0's store is elsewhere (a --tp-rendezvous group); ``parent``: with a
    host, the pid to end with, 0 for none."""
    logging.basicConfig(level=logging.WARNING)
    use_local_gpu(device)
    if host is None:
        threading.Thread(target=_heartbeat, args=(rank, port, parent), daemon=True).start()
        store = dist.TCPStore(HOST, port, world, is_master=False, timeout=STEP_TIMEOUT)
    else:
        store = join_external(rank, world, host, port, join_timeout_s)
        threading.Thread(target=_heartbeat_external, args=(rank, host, port, parent),
                         daemon=True).start()
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world,
                            timeout=STEP_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    runner = None
    while True:
        op, body = _receive(control)
        if op is Op.BUILD:
            runner = _build(rank, world, body, control)
        elif op is Op.STEP:
            with torch.inference_mode():
                runner._run(StepInputs.decode(body))
        elif op is Op.COPY:
            runner.copy_blocks(*Copies.decode(body).lists())
        elif op is Op.SHIFT:
            delta, *blocks = body.tolist()
            runner.shift_keys(blocks, delta)
        elif op is Op.LORA:
            runner.follow_adapter(body)
        elif op is Op.EVICT:
            runner.follow_evict(body)
        elif op in (Op.GATHER_KV, Op.SCATTER_KV, Op.GATHER_HOST, Op.SCATTER_HOST):
            runner.follow_kv(op, body.tolist())
        elif op is Op.CLOSE:
            runner = None
            gc.collect()
        else:  # EXIT
            _leaving.set()
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    r, w, p, d, parent = sys.argv[1:6]
    if len(sys.argv) > 6:  # a rank started elsewhere: host, join timeout
        try:
            follower_main(int(r), int(w), int(p), d, int(parent), sys.argv[6], float(sys.argv[7]))
        except ValueError as e:
            print(f"tandem tp-follower: error: {e}", file=sys.stderr)
            sys.exit(2)
    else:
        follower_main(int(r), int(w), int(p), d, int(parent))
