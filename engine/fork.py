"""n > 1: one prompt, n sequences on shared blocks.

A request with ``SamplingParams.n`` > 1 runs as one request until its prompt is computed
(one prefill); then its n - 1 other choices are forked. Each choice is a Request of its
own (id ``{request_id}#{j}``, ``Request.index`` j) that the scheduler runs, preempts,
swaps and speculates for like any other, and whose outputs go out under the request's
id with their index. Its table starts as the parent's blocks, one more reference each
(KVCacheManager.fork); the block a choice writes next is copied first when another
still holds it (copy-on-write), so memory grows with the new tokens only.

Where the fork happens:
- the step that computes the prompt's last token (colocated, or a decode worker that
  prefills locally): the runner samples every choice from that one logits row, each
  from its own stream (``choice_seed``), so the prompt is computed once;
- a request that arrives with its first token made elsewhere (the decode side of a
  prefill/decode handoff, after its one pull): the prompt's logits are not here, so
  each other choice recomputes the prompt's last position (one decode-sized query
  over the shared blocks, the block it writes copied) and samples its first token
  from it. Choice 0 is the prefill worker's.

A prefill worker (whose requests end after their prompt) never forks: it makes choice
0's first token and hands the prompt on. Aborting the request aborts every choice.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from core.sampling import choice_seed
from engine.request import Request

SEPARATOR = "#"
"""Between a request's id and a choice's index in the choice's own (engine-internal) id."""


def choice_of(parent: Request, index: int, start_guide: Callable | None) -> Request:
    """Choice ``index`` of parent, built (not queued): the prompt, its own seed, a fresh
    grammar state (start_guide(spec)) when constrained; no blocks yet."""
    p = parent.params
    params = replace(p, n=1, seed=None if p.seed is None else choice_seed(p.seed, index))
    child = Request(f"{parent.request_id}{SEPARATOR}{index}", list(parent.prompt_token_ids),
                    params, parent.priority, arrival_time=parent.arrival_time,
                    cache_salt=parent.cache_salt, index=index, group=parent.request_id,
                    forked=True)
    child.lora = parent.lora  # the same adapter (its salt is already in cache_salt)
    child.num_cached_tokens = parent.num_cached_tokens
    child.sampling.eos_token_ids = parent.sampling.eos_token_ids
    if p.guided is not None and start_guide is not None:
        child.sampling.guide = start_guide(p.guided)
    return child


class Choices:
    """The live choices of every forked request, by the request's id (abort finds
    them all, the parent's own choice ended or not)."""

    def __init__(self) -> None:
        self.groups: dict[str, list[Request]] = {}

    def add(self, parent: Request, children: list[Request]) -> None:
        self.groups[parent.request_id] = [parent, *children]

    def live(self, request_id: str) -> list[Request]:
        """The request's choices not finished yet (empty: no forked request of that id)."""
        return [r for r in self.groups.get(request_id, ()) if not r.finished]

    def ended(self, req: Request) -> None:
        """A choice finished: its group goes once every choice has."""
        rid = req.stream_id
        if rid in self.groups and all(r.finished for r in self.groups[rid]):
            del self.groups[rid]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def __len__(self) -> int:
        return len(self.groups)
