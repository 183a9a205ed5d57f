"""What the ranks of a tensor-parallel group share to meet and talk: where rank 0's
store listens, the timeouts, how a rank process is started, the heartbeat keys, and the
encodings of what crosses between them besides a step's plan (engine/parallel/plan.py):
the engine's config, as JSON bytes, and the ranks' build errors."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig

STEP_TIMEOUT = timedelta(seconds=120)
"""Most one collective may wait, the rendezvous included (a backstop: rank 0's
heartbeat watch finds a hung rank first; the ranks' start, importing torch on a busy
machine, needs the margin)."""
IDLE_TIMEOUT = timedelta(days=365)
"""The control group's: the other ranks wait for rank 0's next command this long."""
HOST = "127.0.0.1"
"""Where the ranks rank 0 starts itself reach its store (the store listens on every
interface: ranks started elsewhere reach it at --tp-rendezvous)."""
ERROR_BYTES = 2048
"""Room for one rank's build error in the exchange after a BUILD."""


def config_to_tensor(config: EngineConfig) -> torch.Tensor:
    """An EngineConfig as int64 bytes of its JSON (every field is a plain value)."""
    blob = json.dumps(dataclasses.asdict(config)).encode()
    return torch.tensor(list(blob), dtype=torch.int64)


def config_from_tensor(flat: torch.Tensor) -> EngineConfig:
    groups = json.loads(bytes(flat.tolist()).decode())
    return EngineConfig(**{name: cls(**groups[name]) for name, cls in EngineConfig.groups().items()})


def exchange_errors(mine: str, group) -> list[str]:
    """Every rank's error text ('' where none), in rank order."""
    blob = mine.encode()[:ERROR_BYTES]
    t = torch.zeros(ERROR_BYTES, dtype=torch.uint8)
    t[:len(blob)] = torch.tensor(list(blob), dtype=torch.uint8)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t, group=group)
    return [bytes(p.tolist()).rstrip(b"\0").decode(errors="replace") for p in parts]


def store_error(e: BaseException) -> str:
    """The first line of a store error (torch's carry a C++ trace below it), or its type."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def beat_key(rank: int) -> str:
    return f"tandem/tp/beat/{rank}"


WORLD_KEY = "tandem/tp/world"
"""Set by rank 0 first: the group's size, which a rank started elsewhere checks."""
ERROR_KEY = "tandem/tp/error"
"""Why a rank started elsewhere refused to join (rank 0 raises it at start-up)."""
STOP_KEY = "tandem/tp/stop"
"""Set by rank 0 when the group ends or fails: ranks started elsewhere leave at once."""


def claim_key(rank: int) -> str:
    """Counts the processes that joined as ``rank`` (a second one is refused)."""
    return f"tandem/tp/claim/{rank}"


def external_follower_command(rank: int, world: int, host: str, port: int, device: str,
                              join_timeout_s: float, parent: int = 0) -> list[str]:
    """The command line of a rank that joins a --tp-rendezvous group from outside rank
    0's process tree (``parent``: the pid it ends with, 0 for none)."""
    return [sys.executable, "-m", "engine.parallel.follower", str(rank), str(world), str(port),
            device, str(parent), host, str(join_timeout_s)]


def follower_command(rank: int, world: int, port: int, device: str) -> list[str]:
    """The command line of rank ``rank``'s process."""
    return [sys.executable, "-m", "engine.parallel.follower", str(rank), str(world), str(port),
            device, str(os.getpid())]


LOCAL_RANK = "LOCAL_RANK"
"""A rank's place among its node's ranks (torchrun's name), set by whoever starts it:
which of the node's GPUs it runs on."""


def follower_env(local_rank: int) -> dict[str, str]:
    """This environment, with the directory Tandem is imported from first on the path
    (the ranks must run the very code rank 0 runs) and the rank's ``LOCAL_RANK``."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env[LOCAL_RANK] = str(local_rank)
    return env


def use_local_gpu(device: str) -> None:
    """On CUDA, make this rank's own GPU (``LOCAL_RANK``, 0 where unset) the current
    device, so "cuda" tensors and NCCL use it: without this every rank of a node ran on
    cuda:0. Nothing elsewhere."""
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get(LOCAL_RANK, "0")))


def backend_for(device: str) -> str:
    """NCCL where the model runs on CUDA (and torch has it), gloo otherwise."""
    if device.startswith("cuda") and dist.is_nccl_available():
        return "nccl"
    return "gloo"
