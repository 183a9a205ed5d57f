"""Ranks 1..N-1 of a tensor-parallel group: a process that builds its shard of the
model when rank 0 says BUILD and then runs each forward rank 0 sends, until EXIT.

It holds no scheduler, no requests and no sampler: rank 0 owns those and sends only
the runner's inputs (engine/parallel/plan.py). Any error here ends the process with a
non-zero code, and rank 0's watch then fails the whole group (engine/parallel/group.py):
a rank that cannot run a step must never leave the others waiting in a collective.
"""
from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from engine.parallel.channel import (HOST, IDLE_TIMEOUT, STEP_TIMEOUT, backend_for, beat_key,
                                     config_from_tensor, exchange_errors)
from engine.parallel.plan import Copies, Op, StepInputs

log = logging.getLogger(__name__)


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
        runner = ShardedRunner(config, ckpt, context_window(config.load, ckpt.config), rank, world)
    except Exception as e:  # noqa: BLE001 - rank 0 reports it, naming this rank
        error = f"{type(e).__name__}: {e}"
    exchange_errors(error, control)
    return runner


def follower_main(rank: int, world: int, port: int, device: str, parent: int) -> None:
    """The process of rank ``rank``: meet the group, then serve rank 0's commands."""
    logging.basicConfig(level=logging.WARNING)
    threading.Thread(target=_heartbeat, args=(rank, port, parent), daemon=True).start()
    store = dist.TCPStore(HOST, port, world, is_master=False, timeout=STEP_TIMEOUT)
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
        elif op in (Op.GATHER_KV, Op.SCATTER_KV):
            runner.follow_kv(op, body.tolist(), control)
        elif op is Op.CLOSE:
            runner = None
            gc.collect()
        else:  # EXIT
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    r, w, p, d, parent = sys.argv[1:6]
    follower_main(int(r), int(w), int(p), d, int(parent))
