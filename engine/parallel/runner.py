"""The model runner of one rank of a tensor-parallel group, and the factory that gives
an engine its runner: the plain ModelRunner at --tensor-parallel-size 1 (the path is
then exactly the single-process one), a group of ShardedRunners otherwise.

Rank 0's runner is what the engine holds: before each forward (and each swap) it sends
the inputs to the other ranks, then runs its own shard; the gathered logits land on
every rank, and rank 0 samples. A step at TP > 1 is never interrupted between layers
(the other ranks would wait in the next collective), and it runs eagerly: the compiled
decode step is not built for shards. Packed weights (--quantization) are: each rank
packs its shard as TP 1 packs that part of the weight (engine/parallel/shard.py). LoRA
adapters are too: rank 0 picks each step's slots and sends an adapter to the others as
it makes it resident (each rank keeps its part, engine/lora/layers.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable, Iterator

import torch

from engine.config import EngineConfig
from engine.cpu_limit import default_threads
from engine.loader import LoadedCheckpoint
from engine.model_runner import ModelRunner, prompt_chunks
from engine.models import MODELS
from engine.models.base import CausalLM, meta_skeleton
from engine.parallel.channel import config_to_tensor
from engine.parallel.group import GroupFailed, Rendezvous, TPGroup
from engine.parallel.plan import AdapterSlot, Copies, Op, StepInputs
from engine.parallel.kv_heads import gather_heads, gather_scores, scatter_heads
from engine.parallel.shard import check_shardable, kv_head_map, local_kv_heads, shard_model


def rank_config(config: EngineConfig) -> EngineConfig:
    """What one rank runs: eager, and its share of the cores unless --num-threads says
    otherwise (ranks on one machine must not oversubscribe it; a machine runs
    --tp-ranks-per-node of a --tp-rendezvous group's)."""
    here = config.parallel.ranks_per_node
    threads = config.load.num_threads or max(1, (default_threads() or os.cpu_count() or 1) // here)
    return dataclasses.replace(
        config, load=dataclasses.replace(config.load, num_threads=threads),
        compilation=dataclasses.replace(config.compilation, compile=False))


class ShardedRunner(ModelRunner):
    def __init__(self, config: EngineConfig, ckpt: LoadedCheckpoint, max_model_len: int,
                 rank: int, world: int, group: TPGroup | None = None, owns_group: bool = False,
                 control=None) -> None:
        """group: rank 0's handle on the group (None on the other ranks, which only run
        what rank 0 sends); owns_group: close() ends the group as well; control: another
        rank's control process group (what it sends rank 0 a step's scores over)."""
        self.rank, self.world, self.group, self.owns_group = rank, world, group, owns_group
        self.control = control
        super().__init__(rank_config(config), ckpt, max_model_len)
        if self.lora is not None and group is not None:
            self.lora.on_load = self._send_adapter

    @property
    def kv_heads(self) -> int:
        return local_kv_heads(self.model_config.num_kv_heads, self.world)

    def _split(self, model: CausalLM, row_scales: bool) -> None:
        shard_model(model, self.rank, self.world, self.config.parallel.enable_expert_parallel,
                    row_scales)

    def _run(self, inputs: StepInputs, should_stop: Callable[[], bool] | None = None,
             owed: list = (), scores: dict | None = None):
        """scores (rank 0): every head's h2o accumulators by sequence; each rank adds its
        heads' share of the step into zeros of its own, gathered into these after."""
        if self.group is None:  # another rank: its share of the scores goes to rank 0
            local = self._score_shares(inputs.scored)
            out = super()._run(inputs, scores=local)
            if local:
                gather_scores(list(local.values()), None, self.control)
            return out
        scores = scores or {}
        inputs = dataclasses.replace(inputs, prompt_chunks=prompt_chunks(owed))
        with self._group_op("a step"):
            self.group.send(Op.STEP, inputs.encode())
            local = self._score_shares(inputs.scored)
            out = super()._run(inputs, owed=owed, scores=local)  # no should_stop: every rank finishes it
            if local:
                gather_scores(list(local.values()), self.head_map, self.group.control,
                              list(scores.values()))
            return out

    def _score_shares(self, scored: list[tuple[int, int, int]]) -> dict[int, torch.Tensor]:
        """Zeros [L, this rank's KV heads, slots] per scored sequence, for a step to add into."""
        return {seq: torch.zeros(self.model_config.num_layers, self.kv_heads, slots,
                                 device=self.device) for seq, slots, _ in scored}

    def compact_slots(self, table: list[int], victims: torch.Tensor, slots: int) -> None:
        """Rank 0: every rank evicts h2o's victims from its own heads."""
        if self.group is None:
            return super().compact_slots(table, victims, slots)
        with self._group_op("an h2o eviction"):
            self.group.send(Op.EVICT, torch.tensor(
                [slots, len(table), *table, *victims.flatten().tolist()], dtype=torch.int64))
            super().compact_slots(table, victims[:, self.head_map[0]], slots)

    def follow_evict(self, body: torch.Tensor) -> None:
        """Another rank's part of compact_slots."""
        slots, n = body[:2].tolist()
        table, victims = body[2:2 + n].tolist(), body[2 + n:].view(self.model_config.num_layers, -1)
        super().compact_slots(table, victims[:, self.head_map[self.rank]], slots)

    def _send_adapter(self, slot: int, adapter) -> None:
        """Rank 0, before it fills ``slot`` with ``adapter`` (engine/lora/slots.py): every
        other rank fills it too, each with its part of every linear's A or B."""
        index = {path: i for i, path in enumerate(self.lora.layers)}
        parts = [(index[path], shard, a, b) for path, found in adapter.placed.items()
                 for shard, a, b in found]
        with self._group_op("an adapter load"):
            self.group.send(Op.LORA, AdapterSlot(slot, parts).encode())

    def follow_adapter(self, body: torch.Tensor) -> None:
        """Another rank's part of _send_adapter."""
        load, paths, placed = AdapterSlot.decode(body), list(self.lora.layers), {}
        for layer, shard, a, b in load.parts:
            placed.setdefault(paths[layer], []).append((shard, a, b))
        self.lora.load(load.slot, placed)

    def copy_blocks(self, swap_out: list[tuple[list[int], list[int]]],
                    swap_in: list[tuple[list[int], list[int]]],
                    copies: list[tuple[int, int]] = (), draft_kv: torch.Tensor | None = None
                    ) -> int:
        """draft_kv: a separate draft model's cache, on rank 0 alone (the draft model
        runs there, unsplit): the other ranks copy their target heads only."""
        if self.group is None or not (swap_out or swap_in or copies):
            return super().copy_blocks(swap_out, swap_in, copies, draft_kv)
        with self._group_op("a swap"):
            self.group.send(Op.COPY, Copies.of(swap_out, swap_in, copies).encode())
            return super().copy_blocks(swap_out, swap_in, copies, draft_kv)

    def shift_keys(self, blocks: list[int], delta: int) -> None:
        """Every rank re-rotates its heads' keys of these blocks (a streaming policy
        dropped blocks before them)."""
        if self.group is None:
            return super().shift_keys(blocks, delta)
        with self._group_op("a key shift"):
            self.group.send(Op.SHIFT, torch.tensor([delta, *blocks], dtype=torch.int64))
            return super().shift_keys(blocks, delta)

    @property
    def head_map(self) -> list[list[int]]:
        """Each rank's KV heads, in rank order."""
        return kv_head_map(self.model_config.num_kv_heads, self.world)

    def export_kv(self, ids: list[int]) -> torch.Tensor:
        """Rank 0: blocks ``ids`` with every KV head, gathered from the ranks that hold
        them: ``[n, block bytes of all heads]`` uint8 on the CPU (what a KV transfer
        sends; engine/parallel/kv_heads.py)."""
        return self._gather(Op.GATHER_KV, ids, "a KV gather")

    def import_kv(self, ids: list[int], blocks: torch.Tensor) -> None:
        """Rank 0: write ``blocks`` (every KV head, as export_kv gives them) into blocks
        ``ids``, each rank its heads."""
        self._scatter(Op.SCATTER_KV, ids, blocks, "a KV scatter")

    def read_host_blocks(self, slots: list[int]) -> torch.Tensor:
        """Rank 0: host slots with every KV head, gathered from the ranks (a block
        spilled to the disk tier)."""
        return self._gather(Op.GATHER_HOST, slots, "a host block gather")

    def write_host_blocks(self, slots: list[int], blocks: torch.Tensor) -> None:
        """Rank 0: host slots := ``blocks`` (every KV head), each rank its heads (a disk
        read landing)."""
        self._scatter(Op.SCATTER_HOST, slots, blocks, "a host block scatter")

    def _pool(self, op: Op) -> torch.Tensor:
        """The tensor a head gather or scatter reads or writes: the host slots' or the
        device pool."""
        return self.swap_kv if op in (Op.GATHER_HOST, Op.SCATTER_HOST) else self.kv

    def _gather(self, op: Op, ids: list[int], what: str) -> torch.Tensor:
        with self._group_op(what):
            self.group.send(op, torch.tensor(ids, dtype=torch.int64))
            return gather_heads(self._pool(op), ids, self.head_map, self.group.control)

    def _scatter(self, op: Op, ids: list[int], blocks: torch.Tensor, what: str) -> None:
        with self._group_op(what):
            self.group.send(op, torch.tensor(ids, dtype=torch.int64))
            scatter_heads(self._pool(op), ids, self.head_map, self.group.control, blocks)

    def follow_kv(self, op: Op, ids: list[int]) -> None:
        """Another rank's part of _gather / _scatter."""
        if op in (Op.GATHER_KV, Op.GATHER_HOST):
            gather_heads(self._pool(op), ids, None, self.control)
        else:
            scatter_heads(self._pool(op), ids, None, self.control)

    def raise_if_broken(self) -> None:
        if self.group is not None:
            with self._group_op("the group"):
                self.group.raise_if_failed()

    @contextlib.contextmanager
    def _group_op(self, what: str) -> Iterator[None]:
        """Rank 0's part of a group operation. Any error fails the group (the other
        ranks may be mid-operation, waiting in a collective that will never come), and
        the group is shut down here, on the thread that ran its collectives."""
        try:
            yield
        except GroupFailed:
            self.group.shutdown()
            raise
        except Exception as e:
            failed = self.group.fail(f"{what} failed on rank 0: {type(e).__name__}: {e}")
            self.group.shutdown()
            raise failed from e

    def close(self) -> None:
        if self.group is None:
            return
        if self.group.failed is None:
            try:
                self.group.send(Op.CLOSE)
            except GroupFailed:
                pass
        if self.owns_group:
            self.group.shutdown()


def make_runner(config: EngineConfig, ckpt: LoadedCheckpoint, max_model_len: int,
                group: TPGroup | None = None) -> ModelRunner:
    """The engine's runner. At TP > 1 the split is checked before any process starts;
    ``group``: an existing group of that size to build on (tests share one), else the
    runner starts its own and ends it on close()."""
    world = config.parallel.tensor_parallel_size
    if world == 1:
        return ModelRunner(config, ckpt, max_model_len)
    with meta_skeleton():
        check_shardable(MODELS.load(ckpt.config.architecture)(ckpt.config, max_model_len), world,
                        config.parallel.enable_expert_parallel)
    if group is not None and group.world != world:
        raise ValueError(f"--tensor-parallel-size {world} on a group of {group.world} ranks")
    owned = group is None
    group = group or TPGroup(world, config.load.device, Rendezvous.of(config.parallel))
    try:
        return _build_on(group, config, ckpt, max_model_len, owned)
    except BaseException:
        if owned:
            group.shutdown()
        raise


def _build_on(group: TPGroup, config: EngineConfig, ckpt: LoadedCheckpoint, max_model_len: int,
              owned: bool) -> ShardedRunner:
    """Every rank builds its shard; any rank's error is raised here, naming the rank."""
    group.send(Op.BUILD, config_to_tensor(config))
    runner, error, mine = None, None, ""
    try:
        runner = ShardedRunner(config, ckpt, max_model_len, 0, group.world, group, owned)
    except Exception as e:  # noqa: BLE001 - the others must hear of it before it is raised
        error, mine = e, f"{type(e).__name__}: {e}"
    errors = group.gather_errors(mine)
    if error is None and not any(errors):
        return runner
    group.send(Op.CLOSE)
    if error is not None:
        raise error
    rank, text = next((r, t) for r, t in enumerate(errors) if t)
    raise ValueError(f"--tensor-parallel-size {group.world}: rank {rank} could not build "
                     f"its shard: {text}")
