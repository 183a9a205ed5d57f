"""Token masks for the constrained rows of a step, built beside its forward pass.

The runner calls ``submit`` before the forward (a mask depends only on tokens
committed in earlier steps) and ``result`` once the logits exist; between the two,
one worker thread has llguidance's executor fill a bitmask for every constrained row
at once (its Rust threads drop the GIL) and unpacks it to a boolean [B, V] mask of refused tokens, so
the sampler's share is one masked fill over the whole batch. A batch with no
constrained row submits nothing.

A speculating row has a mask per verified position: its grammar's state before the
step, then after each guess. The worker thread consumes the guesses one by one into
the row's matcher, filling a mask before each, and rolls them back at the end (the
engine thread touches no matcher until ``result``; it then commits the accepted tokens
as it does any others).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import numpy as np
import torch

from core.guided.compiler import GuidedState


@dataclass
class MaskStats:
    """Recent steps, for the benchmark (bench/structured.py)."""

    build_seconds: deque = field(default_factory=lambda: deque(maxlen=100_000))
    """Per step: time the worker thread spent on the masks (llguidance and unpacking)."""
    rows: deque = field(default_factory=lambda: deque(maxlen=100_000))
    """Per step: constrained rows."""
    wait_seconds: deque = field(default_factory=lambda: deque(maxlen=100_000))
    """Per step: time the engine thread waited for the masks after its forward."""


def banned(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 (bit i of word w allows token 32w + i) -> [B, V] bool,
    True where the token is refused. numpy's unpackbits: ~20x faster than torch shifts."""
    refused = np.bitwise_not(bitmask.numpy()).view(np.uint8)  # little-endian words
    bits = np.unpackbits(refused, axis=1, bitorder="little")[:, :vocab_size]  # [B, V] 0/1
    return torch.from_numpy(bits).view(torch.bool)


class MaskBuilder:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="guided-mask")
        self._executor = llguidance.LLExecutor()  # Rust threads: 80% of the cores, up to 32
        self.stats = MaskStats()

    def submit(self, guides: Sequence[GuidedState | None], vocab_size: int,
               drafts: Sequence[Sequence[int]] | None = None) -> Future[torch.Tensor] | None:
        """Start the masks of one step's sampled rows (None: no row is constrained).
        drafts[i]: row i's guesses; it then takes 1 + len(drafts[i]) mask rows, in order."""
        drafts = drafts or [()] * len(guides)
        rows, spec, at = [], [], 0
        for g, d in zip(guides, drafts):
            if g is not None and not g.error:
                if d:
                    spec.append((g.matcher, at, list(d)))
                else:
                    rows.append((g.matcher, at))
            at += 1 + len(d)
        if not rows and not spec:
            return None
        return self._pool.submit(self._build, rows, spec, at, vocab_size)

    def result(self, future: Future[torch.Tensor]) -> torch.Tensor:
        t0 = time.perf_counter()
        mask = future.result()
        self.stats.wait_seconds.append(time.perf_counter() - t0)
        return mask

    def _build(self, rows: list[tuple[llguidance.LLMatcher, int]],
               spec: list[tuple[llguidance.LLMatcher, int, list[int]]], batch: int,
               vocab_size: int) -> torch.Tensor:
        t0 = time.perf_counter()
        words = (vocab_size + 31) // 32
        bitmask = torch.full((batch, words), -1, dtype=torch.int32)  # unconstrained: all allowed
        if rows:
            self._executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), words * 4, batch)
        for matcher, at, draft in spec:  # a mask per position, each after the guesses before it
            consumed = 0
            for j in range(len(draft) + 1):
                self._executor.unsafe_compute_mask_ptr([(matcher, at + j)], bitmask.data_ptr(),
                                                       words * 4, batch)
                if j == len(draft) or not matcher.consume_token(draft[j]):
                    break  # later positions are never reached: their guess is refused here
                consumed += 1
            matcher.rollback(consumed)
        mask = banned(bitmask, vocab_size)
        self.stats.build_seconds.append(time.perf_counter() - t0)
        self.stats.rows.append(len(rows) + len(spec))
        return mask

    def close(self) -> None:
        self._pool.shutdown(wait=True)
