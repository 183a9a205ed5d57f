"""A tensor-parallel group as rank 0 sees it: the other ranks' processes, the
torch.distributed rendezvous, the command channel to them, and the watch that fails
the group as one.

Rank 0 is the process that serves (the worker, ``tandem generate``, a test); ranks
1..N-1 are started here (engine/parallel/follower.py), one process each, and meet at
rank 0's TCP store on 127.0.0.1, which also carries their heartbeats. With a
rendezvous (--tp-rendezvous, a group spread over pods) rank 0 starts only the ranks of
its own node; the others are started elsewhere (`tandem tp-follower`), join at the
store's address, and are watched by their heartbeats alone (rank 0 holds no process
of theirs); they watch rank 0's heartbeat in turn and leave when it stops. Two process groups join them: the default one runs the model's
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
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.config import ParallelConfig, parse_rendezvous
from engine.parallel.channel import (ERROR_KEY, HOST, IDLE_TIMEOUT, STEP_TIMEOUT, STOP_KEY,
                                     WORLD_KEY, backend_for, beat_key, exchange_errors,
                                     follower_command, follower_env, store_error)
from engine.parallel.plan import Op

log = logging.getLogger(__name__)

HANG_SECONDS = 10.0
"""A rank whose heartbeat has not moved for this long is taken as hung."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of a group spread over nodes meet (--tp-rendezvous)."""

    address: str
    """HOST:PORT, as given (rank 0 listens on PORT, every interface)."""
    local_ranks: int
    """Ranks on rank 0's node, rank 0 included (it starts ranks 1..local_ranks-1)."""
    join_timeout_s: float

    @property
    def port(self) -> int:
        return parse_rendezvous(self.address, "--tp-rendezvous")[1]

    @classmethod
    def of(cls, parallel: ParallelConfig) -> Rendezvous | None:
        if parallel.tp_rendezvous is None:
            return None
        return cls(parallel.tp_rendezvous, parallel.ranks_per_node, parallel.tp_join_timeout_s)


class GroupFailed(BaseException):
    """The group lost a rank: no step can run on it again. A BaseException, not an
    Exception, on purpose: LLMEngine.step fails a raising step's requests and goes on,
    which is right for a request's error but not here, where the engine must stop."""


class TPGroup:
    """Rank 0's handle on a group of ``world`` ranks (the caller's process is rank 0)."""

    def __init__(self, world: int, device: str = "cpu",
                 rendezvous: Rendezvous | None = None) -> None:
        """rendezvous: where ranks started elsewhere join (None: all start here)."""
        if dist.is_initialized():
            raise ValueError("--tensor-parallel-size: this process already belongs to a "
                             "tensor-parallel group (one engine per group)")
        self.world, self.device, self.rendezvous = world, device, rendezvous
        self.failed: str | None = None
        self._failing = threading.Lock()
        self._stop = threading.Event()
        local = world if rendezvous is None else rendezvous.local_ranks
        self.external = list(range(local, world))
        """Ranks started elsewhere (no process handle: watched by heartbeat only)."""
        self._store = self._listen()
        self._store.set(WORLD_KEY, str(world))
        self._beat = threading.Thread(target=self._beat_rank0, name="tp-beat", daemon=True)
        if self.external:  # joined ranks watch it from the start, a slow join included
            self._beat.start()
        # a fresh interpreter per rank (never a fork of a process holding torch's threads)
        self._procs = {r: subprocess.Popen(follower_command(r, world, self._store.port, device),
                                           env=follower_env(r)) for r in range(1, local)}
        try:
            if self.external:
                self._await_joins()
            dist.init_process_group(backend_for(device), store=self._store, rank=0,
                                    world_size=world, timeout=STEP_TIMEOUT)
            self._control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        except BaseException:
            self._stop.set()
            self._tell_external(STOP_KEY)  # a joined rank must not wait for the others
            self._kill()
            raise
        self._watch = threading.Thread(target=self._watch_ranks, name="tp-watch", daemon=True)
        self._watch.start()

    def _listen(self) -> dist.TCPStore:
        """Rank 0's store (it listens on every interface, whatever the host given)."""
        port = self.rendezvous.port if self.rendezvous else 0
        try:
            return dist.TCPStore(HOST, port, self.world, is_master=True, timeout=STEP_TIMEOUT,
                                 wait_for_workers=False)
        except RuntimeError as e:
            if self.rendezvous is None:
                raise
            raise ValueError(f"--tp-rendezvous {self.rendezvous.address}: rank 0 cannot listen "
                             f"on port {port} ({store_error(e)})") from None

    def _await_joins(self) -> None:
        """Wait until every rank started elsewhere has joined (its first heartbeat), or
        raise naming the flag, the address and the ranks missing."""
        rv = self.rendezvous
        deadline = time.monotonic() + rv.join_timeout_s
        while True:
            if self._store.check([ERROR_KEY]):
                raise ValueError(f"--tp-rendezvous {rv.address}: "
                                 f"{self._store.get(ERROR_KEY).decode()}")
            missing = [r for r in self.external if self._store.add(beat_key(r), 0) == 0]
            if not missing:
                return
            for r, p in self._procs.items():
                if p.poll() is not None:
                    raise ValueError(f"--tensor-parallel-size {self.world}: rank {r} "
                                     f"(pid {p.pid}) exited with code {p.returncode} "
                                     "before the group met")
            if time.monotonic() > deadline:
                raise ValueError(
                    f"--tp-rendezvous {rv.address}: rank(s) {', '.join(map(str, missing))} "
                    f"of --tensor-parallel-size {self.world} did not join within "
                    f"--tp-join-timeout-s {rv.join_timeout_s:g} (start them with "
                    f"`tandem tp-follower --tp-rendezvous {rv.address} ...`)")
            time.sleep(0.2)

    def _beat_rank0(self) -> None:
        """Rank 0's heartbeat, which ranks started elsewhere watch (they have no parent
        process to watch)."""
        store = self._client()
        while not self._stop.wait(0.5):
            try:
                store.add(beat_key(0), 1)
            except RuntimeError:
                return

    def _client(self, timeout: timedelta = timedelta(seconds=HANG_SECONDS)) -> dist.TCPStore:
        """A store client of this thread's own (clients are not shared across threads)."""
        return dist.TCPStore(HOST, self._store.port, is_master=False, timeout=timeout)

    def _tell_external(self, key: str) -> None:
        """Set ``key`` for the ranks started elsewhere (best effort)."""
        if self.external:
            try:
                self._client().set(key, "1")
            except RuntimeError:
                pass

    @property
    def pids(self) -> list[int]:
        """The process ids of the ranks started here (rank 1 first)."""
        return [p.pid for p in self._procs.values()]

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
                self._tell_external(STOP_KEY)  # ranks started elsewhere leave at once
            self._kill()
        return GroupFailed(self.failed)

    def _lost_rank(self, wait_s: float = 2.0) -> str | None:
        """Which rank exited, where one did: a collective that fails because a rank died
        often fails a moment before the process is seen gone, and the rank is the news."""
        deadline = time.monotonic() + wait_s
        while True:
            for r, p in self._procs.items():
                if p.poll() is not None:
                    return f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def _watch_ranks(self) -> None:
        store = self._client(STEP_TIMEOUT)
        seen = {r: (-1, time.monotonic()) for r in range(1, self.world)}
        while not self._stop.wait(0.5):
            for r in range(1, self.world):
                if self._stop.is_set():  # shutting down: ranks leave on EXIT
                    return
                p = self._procs.get(r)
                if p is not None and p.poll() is not None:
                    self.fail(f"rank {r} exited")  # _lost_rank names it
                    return
                beat, since = seen[r]
                try:
                    now = store.add(beat_key(r), 0)
                except RuntimeError as e:  # our own store: only a dying process gets here
                    self.fail(f"rank 0's store stopped answering: {e}")
                    return
                if now != beat:
                    seen[r] = (now, time.monotonic())
                elif time.monotonic() - since > HANG_SECONDS:
                    who = (f"pid {p.pid}" if p is not None
                           else f"started elsewhere, joined at {self.rendezvous.address}")
                    self.fail(f"rank {r} ({who}) stopped answering "
                              f"(no heartbeat for {HANG_SECONDS:.0f} s)")
                    return

    def _kill(self) -> None:
        """End the ranks started here."""
        for p in self._procs.values():
            if p.poll() is None:
                p.kill()
        for p in self._procs.values():
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
            for p in self._procs.values():
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
        self._kill()
        self._watch.join(timeout=5)
        if self._beat.is_alive():
            self._beat.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
