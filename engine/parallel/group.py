"""A tensor-parallel group as rank 0 sees it: the other ranks' processes, the
torch.distributed rendezvous, the command channel to them, and the watch that fails
the group as one.

Rank 0 is the process that serves (the worker, ``tandem generate``, a test); ranks
1..N-1 are started here (engine/parallel/follower.py), one process each, and meet at
rank 0's TCP store on 127.0.0.1, which also carries their heartbeats. Two process groups join them: the default one runs the model's
collectives under a timeout (a rank stuck mid-step fails it), the control one carries
rank 0's commands and may wait for the next one as long as the engine idles.

A group fails as one: a rank that exits, or whose heartbeat stops for HANG_SECONDS (a
hung process), fails the whole group within seconds: the watch kills every other rank
(so no collective on rank 0 waits on them) and ``failed`` says why. The engine thread
then dies on GroupFailed (engine/parallel/runner.py), which turns the worker's health
NOT_SERVING and ends it, as for any dead engine.
"""
from __future__ import annotations

import logging
import subprocess
import threading
import time

import torch
import torch.distributed as dist

from engine.parallel.channel import (HOST, IDLE_TIMEOUT, STEP_TIMEOUT, backend_for, beat_key,
                                     exchange_errors, follower_command, follower_env)
from engine.parallel.plan import Op

log = logging.getLogger(__name__)

HANG_SECONDS = 10.0
"""A rank whose heartbeat has not moved for this long is taken as hung."""


class GroupFailed(BaseException):
    """The group lost a rank: no step can run on it again. A BaseException, not an
    Exception, on purpose: LLMEngine.step fails a raising step's requests and goes on,
    which is right for a request's error but not here, where the engine must stop."""


class TPGroup:
    """Rank 0's handle on a group of ``world`` ranks (the caller's process is rank 0)."""

    def __init__(self, world: int, device: str = "cpu") -> None:
        if dist.is_initialized():
            raise ValueError("--tensor-parallel-size: this process already belongs to a "
                             "tensor-parallel group (one engine per group)")
        self.world, self.device = world, device
        self.failed: str | None = None
        self._failing = threading.Lock()
        self._store = dist.TCPStore(HOST, 0, world, is_master=True, timeout=STEP_TIMEOUT,
                                    wait_for_workers=False)
        # a fresh interpreter per rank (never a fork of a process holding torch's threads)
        self._procs = [subprocess.Popen(follower_command(r, world, self._store.port, device),
                                        env=follower_env()) for r in range(1, world)]
        try:
            dist.init_process_group(backend_for(device), store=self._store, rank=0,
                                    world_size=world, timeout=STEP_TIMEOUT)
            self._control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        except BaseException:
            self._kill()
            raise
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_ranks, name="tp-watch", daemon=True)
        self._watch.start()

    @property
    def pids(self) -> list[int]:
        """The other ranks' process ids (rank 1 first)."""
        return [p.pid for p in self._procs]

    @property
    def control(self):
        """The process group rank 0's commands, and the KV moves that follow some of
        them (engine/parallel/kv_heads.py), run on."""
        return self._control

    def send(self, op: Op, payload: torch.Tensor | None = None) -> None:
        """Rank 0's command to every other rank: GroupFailed once the group has failed."""
        self.raise_if_failed()
        body = payload if payload is not None else torch.zeros(0, dtype=torch.int64)
        try:
            dist.broadcast(torch.tensor([int(op), body.numel()], dtype=torch.int64), 0,
                           group=self._control)
            if body.numel():
                dist.broadcast(body, 0, group=self._control)
        except RuntimeError as e:
            raise self.fail(f"sending {op.name} to the other ranks failed: {e}") from e

    def gather_errors(self, mine: str) -> list[str]:
        """Every rank's error text after a BUILD ('' where it built)."""
        return exchange_errors(mine, self._control)

    def raise_if_failed(self) -> None:
        if self.failed is not None:
            raise GroupFailed(self.failed)

    def fail(self, reason: str) -> GroupFailed:
        """Mark the group failed (first reason wins), end every other rank, return the
        exception to raise."""
        with self._failing:  # the watch and the engine thread may both find it
            if self.failed is None:
                self.failed = f"tensor-parallel group failed: {self._lost_rank() or reason}"
                log.critical("%s", self.failed)
            self._kill()
        return GroupFailed(self.failed)

    def _lost_rank(self, wait_s: float = 2.0) -> str | None:
        """Which rank exited, where one did: a collective that fails because a rank died
        often fails a moment before the process is seen gone, and the rank is the news."""
        deadline = time.monotonic() + wait_s
        while True:
            for r, p in enumerate(self._procs, start=1):
                if p.poll() is not None:
                    return f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def _watch_ranks(self) -> None:
        store = dist.TCPStore(HOST, self._store.port, is_master=False, timeout=STEP_TIMEOUT)
        seen = {r: (-1, time.monotonic()) for r in range(1, self.world)}
        while not self._stop.wait(0.5):
            for r, p in enumerate(self._procs, start=1):
                if self._stop.is_set():  # shutting down: ranks leave on EXIT
                    return
                if p.poll() is not None:
                    self.fail(f"rank {r} exited")  # _lost_rank names it
                    return
                beat, since = seen[r]
                now = store.add(beat_key(r), 0)
                if now != beat:
                    seen[r] = (now, time.monotonic())
                elif time.monotonic() - since > HANG_SECONDS:
                    self.fail(f"rank {r} (pid {p.pid}) stopped answering "
                              f"(no heartbeat for {HANG_SECONDS:.0f} s)")
                    return

    def _kill(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            p.wait(timeout=10)

    def shutdown(self) -> None:
        """End the other ranks (EXIT, then a kill for any that does not) and leave the
        group; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.failed is None:
            try:
                self.send(Op.EXIT)
            except GroupFailed:
                pass
            for p in self._procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
        self._kill()
        self._watch.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
