"""A tensor-parallel group fails as one: rank 1 killed mid-stream, killed while the
engine idles, or stopped (a hang), makes the engine thread die within seconds, so every
stream ends with an error, ``alive`` turns False and ``on_death`` runs (the worker
services turn health NOT_SERVING and exit on it, worker/base.py); no rank process is
left behind. Each test starts its own group (this process is rank 0 of one at a time)."""
from __future__ import annotations

import asyncio
import os
import re
import signal

import psutil
import pytest

from core.sampling import SamplingParams
from engine.engine_thread import EngineDead, EngineWorker
from engine.llm_engine import LLMEngine
from engine.request import FinishReason
from tests.models.families import prompts
from tests.models.test_tensor_parallel import config

WAIT_S = 90.0
"""Generous: the watch notices within HANG_SECONDS (10 s) plus a poll; the machine is shared."""


def _ranks() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "engine.parallel.follower" in " ".join(p.cmdline())]


async def _start(path) -> tuple[EngineWorker, asyncio.Event]:
    died = asyncio.Event()
    worker = EngineWorker(lambda: LLMEngine(config(path, 2)), on_death=lambda e: died.set())
    await worker.start()
    return worker, died


async def _stream_until_error(worker: EngineWorker, rank1: psutil.Process, how: int) -> str:
    """Start a long request, signal rank 1 once tokens flow, return the stream's end."""
    req = await worker.make_request(prompts(1, seed=4)[0],
                                    SamplingParams(max_tokens=200, temperature=0.0,
                                                   ignore_eos=True), "r1")
    q = await worker.add(req)
    await asyncio.wait_for(q.get(), WAIT_S)  # the first token: the group runs
    os.kill(rank1.pid, how)
    while True:
        out = await asyncio.wait_for(q.get(), WAIT_S)
        if out.finished:
            assert out.finish_reason is FinishReason.ERROR, out
            return out.error


@pytest.mark.parametrize("how, why", [(signal.SIGKILL, "rank 1 .* exited with code -9"),
                                      (signal.SIGSTOP, "rank 1 .* stopped answering")])
def test_a_rank_lost_mid_stream_fails_the_engine(checkpoint, how: int, why: str) -> None:
    async def main() -> None:
        worker, died = await _start(checkpoint("llama"))
        try:
            [rank1] = _ranks()
            error = await _stream_until_error(worker, rank1, how)
            assert re.search(f"tensor-parallel group failed: {why}", error), error
            await asyncio.wait_for(died.wait(), WAIT_S)
            assert not worker.alive
            with pytest.raises(EngineDead, match=f"tensor-parallel group failed: {why}"):
                await worker.add(await worker.make_request([5, 6, 7], SamplingParams(), "r2"))
        finally:
            worker.stop()
        assert _ranks() == []
    asyncio.run(main())


def test_a_rank_lost_while_idle_fails_the_engine(checkpoint) -> None:
    async def main() -> None:
        worker, died = await _start(checkpoint("llama"))
        try:
            [rank1] = _ranks()
            rank1.kill()
            await asyncio.wait_for(died.wait(), WAIT_S)
            assert not worker.alive
        finally:
            worker.stop()
        assert _ranks() == []
    asyncio.run(main())
