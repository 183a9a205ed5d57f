"""Swap-out on CUDA must not read the host copy before the device-to-host copy has
landed (the old code index-assigned a pinned staging tensor still being filled)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model_runner import ModelRunner


@pytest.mark.gpu
def test_swap_out_then_in_round_trips_while_the_stream_is_busy() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    shape = (64, 30, 2, 16, 3, 64)  # the embedded model's block layout, 64 blocks
    kv = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    swap = torch.zeros((32, *shape[1:]), dtype=torch.bfloat16, pin_memory=True)
    runner = SimpleNamespace(kv=kv, swap_kv=swap, device=dev,
                             block_bytes=kv[0].numel() * kv.element_size())
    src, host = list(range(0, 64, 2)), list(range(32))
    want = kv[src].cpu()
    busy = torch.randn(8192, 8192, device=dev)
    for _ in range(20):  # queue seconds of work ahead of the copies
        busy = busy @ busy
        busy /= busy.norm()
    ModelRunner.copy_blocks(runner, [(src, host)], [])
    assert torch.equal(swap, want), "swap pool read before the device-to-host copy landed"
    kv[src] = 0
    ModelRunner.copy_blocks(runner, [], [(host, src)])
    assert torch.equal(kv[src].cpu(), want)
