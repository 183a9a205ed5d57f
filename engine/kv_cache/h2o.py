"""H2O's heavy hitters (arXiv 2306.14048) over the paged cache, under ``--kv-policy
h2o:heavy=H,recent=R[,sinks=S][,halflife=T][,score=mean]`` (core/kv/policy.py).

Granularity: tokens, chosen per layer and per KV head, as in the paper. A request's
table is its cache's slots, budget = H + R of them (S + H + R under ``sinks=S``) in
ceil(budget / B) blocks (never more: the memory is the budget's blocks). Attention adds
each key's probability, summed over the step's queries and over the KV head's group of
query heads, into the request's scores [L, Hkv, budget] (engine/attention/base.py
add_scores: the decode kernel copies out the scores it computes anyway; nothing is read
twice). Under ``halflife=T`` the scores fade by 2 ** (-1 / T) per token before each
token's attention adds in (A2SF, arXiv 2407.20485), so a heavy hitter that stops drawing
attention loses its place; a step of n tokens fades the accumulator by that factor ** n
and weights its queries so the sum equals adding them one at a time, whatever the
chunking. When a step's last token fills the last slot, every (layer, KV head) evicts
the slot with the least accumulated score among the first H (after the S sinks under
``sinks=S``, which never move; the last R slots, the newest tokens with the current one,
are never evicted); the slots after it move one down with their scores, their keys
re-rotated by -1 (positions within the cache, as under streaming), and the next token is
written into the freed last slot. So a query sees S + H + R tokens: itself, the R - 1
before it, H heavy hitters and the S sinks.

Under ``score=mean`` the victim is the least mean instead: a slot's score divided by the
queries its token has seen (itself and every later one; under a halflife each query
counted with the weight its attention carries, so the divisor is 1 + d + ... +
d ** (age - 1) for the fading d). A plain sum grows with a token's age, so on a long
input the heavy part fills with old tokens that once drew attention (docs/performance.md
l, the trace of the heavy part); the mean compares tokens of any age by their draw. The
request keeps each slot's token's index in its input (``Request.kv_arrivals``
[L, Hkv, budget], int32), moved with the scores: the queries a slot has seen are its
token's age.

Why per head and per token: heads disagree on which tokens matter (the paper's
selection is per head), and in the block-major cache each (layer, head) row of a slot
is its own row, so compacting per head is one gather along the slot axis with no extra
memory. Evicting whole blocks would have to drop B tokens that score low together,
which H2O's scores do not group (unlike streaming's fixed order).

The scores (and under ``score=mean`` the arrivals) live on the request
(``Request.kv_scores``, ``kv_arrivals``): they follow its slots through a swap, are
rebuilt by a recompute (from its first token), and go with the request. They
cover every KV head of the model: at --tensor-parallel-size > 1 rank 0 keeps them, each
rank adds its heads' share of a step (engine/parallel/runner.py), and rank 0 picks the
victims, which every rank then evicts from its own heads (``compact``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from core.kv.policy import decay_per_token
from engine.kv_cache.policy import kept_tokens
from engine.kv_cache.shift import rotated_keys

if TYPE_CHECKING:
    from engine.request import Request


def step_scores(scored: list[tuple[Request, int, int]], layers: int, kv_heads: int,
                device: torch.device) -> dict[int, torch.Tensor]:
    """Sequence index -> a copy of its request's scores for this step to add into (a
    step abandoned midway adds nothing: ``keep_scores`` takes the copies afterwards);
    zeros for a request starting from its first token (new, or recomputed), and under
    ``score=mean`` its arrivals 0, 1, ..., budget - 1 (slot s's first token is token s).
    Under a halflife the copy has faded by the step's n tokens (its queries' own weights
    are add_scores')."""
    out = {}
    for req, seq, n in scored:
        if req.kv_scores is None or req.num_computed_tokens == 0:
            budget = req.kv_policy.budget
            req.kv_scores = torch.zeros(layers, kv_heads, budget, device=device)
            req.kv_arrivals = None
            if req.kv_policy.score == "mean":
                req.kv_arrivals = torch.arange(budget, dtype=torch.int32, device=device
                                               ).expand(layers, kv_heads, budget).clone()
        out[seq] = req.kv_scores.to(device, copy=True)  # from a P/D handoff: on the host
        if req.kv_policy.halflife:
            out[seq] *= decay_per_token(req.kv_policy.halflife) ** n
    return out


@torch.inference_mode()
def keep_scores(scored: list[tuple[Request, int, int]], scores: dict[int, torch.Tensor],
                tables: dict[int, list[int]],
                compact_slots: Callable[[list[int], torch.Tensor, int], None]) -> None:
    """After a step's forward: each scored request takes its scores, and one whose last
    slot this step filled evicts: its scores here (``evict``), its KV through
    ``compact_slots(table, victims, slots)`` (the runner's: every rank its heads)."""
    for req, seq, n in scored:
        req.kv_scores = scores[seq]
        policy = req.kv_policy
        if kept_tokens(policy, req.num_computed_tokens) + n == policy.budget:
            total = req.num_computed_tokens + n  # the next token's index in the input
            if req.kv_arrivals is not None:  # from a P/D handoff: on the host
                req.kv_arrivals = req.kv_arrivals.to(req.kv_scores.device)
            victims = evict(req.kv_scores, policy.sinks, policy.heavy, req.kv_arrivals,
                            total, decay_per_token(policy.halflife))
            compact_slots(tables[seq], victims, req.kv_scores.shape[-1])


def evict(scores: torch.Tensor, sinks: int, heavy: int, arrivals: torch.Tensor | None = None,
          total: int = 0, fade: float = 1.0) -> torch.Tensor:
    """In a full cache of slots = scores.shape[-1] tokens, pick per (layer, KV head) the
    least-scored of the ``heavy`` slots after the first ``sinks`` and move the later
    scores down (the last slot then scores 0): the victims [L, Hkv] for ``compact``.
    With ``arrivals`` (score=mean: each slot's token's index in the input, after
    ``total`` tokens) a slot's score is divided by the (faded) queries it has seen first,
    and the arrivals move with the scores, the last slot's becoming ``total``."""
    slots = scores.shape[-1]
    rank = scores[:, :, sinks:sinks + heavy]
    if arrivals is not None:
        rank = rank / queries_seen(total - arrivals[:, :, sinks:sinks + heavy], fade)
    victim = rank.argmin(-1) + sinks  # [L, Hkv]
    j = torch.arange(slots - 1, device=scores.device)
    src = j.view(1, 1, -1) + (j.view(1, 1, -1) >= victim.unsqueeze(-1))
    scores[:, :, :slots - 1] = scores.gather(-1, src)
    scores[:, :, slots - 1] = 0
    if arrivals is not None:
        arrivals[:, :, :slots - 1] = arrivals.gather(-1, src)
        arrivals[:, :, slots - 1] = total
    return victim


def queries_seen(age: torch.Tensor, fade: float) -> torch.Tensor:
    """The weight of the queries a token ``age`` tokens old has seen, itself among them:
    ``age``, or under a fading d the sum 1 + d + ... + d ** (age - 1) their attention
    carries in its score."""
    age = age.to(torch.float32)
    return age if fade == 1.0 else (1 - torch.pow(fade, age)) / (1 - fade)


def compact(kv: torch.Tensor, model: torch.nn.Module, table: list[int], victim: torch.Tensor,
            slots: int, kv_quant: str | None) -> None:
    """In a full cache of ``slots`` tokens over ``table``'s blocks, drop per (layer, KV
    head) the slot ``victim`` [L, Hkv] names and move the later ones down (keys re-rotated
    by -1); the last slot is then free."""
    layers, hkv = victim.shape
    bs = kv.shape[3]
    victim = victim.to(kv.device)
    lo = int(victim.min()) // bs * bs  # slots before lo's block stay where they are
    idx = torch.as_tensor(table[lo // bs: -(-slots // bs)], dtype=torch.long, device=kv.device)
    x = kv.index_select(0, idx)  # [n, L, 2, B, Hkv, R]
    n, row = x.shape[0], x.shape[-1]
    x = x.permute(1, 2, 0, 3, 4, 5).reshape(layers, 2, n * bs, hkv, row)
    j = torch.arange(lo, slots - 1, device=kv.device)  # the slots that may change
    moved = j.view(1, 1, -1) >= victim.unsqueeze(-1)  # [L, Hkv, S']
    src = j.view(1, 1, -1) + moved  # each slot takes the next one's token from the victim on
    at = (src - lo).permute(0, 2, 1)  # [L, S', Hkv]
    rows = x.gather(2, at[:, None, :, :, None].expand(layers, 2, -1, hkv, row))
    keys = rows[:, 0]  # [L, S', Hkv, row]
    rows[:, 0] = torch.where(moved.permute(0, 2, 1).unsqueeze(-1),
                             rotated_keys(keys, model, -1, kv_quant, layer_dim=0), keys)
    x[:, :, :slots - 1 - lo] = rows
    kv[idx] = x.view(layers, 2, n, bs, hkv, row).permute(2, 0, 1, 3, 4, 5)
