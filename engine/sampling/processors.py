"""Batched logit transforms: penalties, temperature, top-k, top-p, min-p.

Every function works on a float32 [B, V] tensor with one parameter per row and
is strictly row-wise, so a row's result never depends on its batch mates (the
sampler's reproducibility rests on this). The ``*_`` functions modify in place.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

_NEG_INF = float("-inf")


def token_counts(seqs: Sequence[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """[len(seqs), V] float32 occurrence counts, one scatter_add for the whole batch.

    Rows are padded with id ``vocab_size``, which lands in a spare column that is
    dropped; ids >= vocab_size are therefore ignored.
    """
    device = seqs[0].device
    ids = pad_sequence([s.clamp(max=vocab_size) for s in seqs], batch_first=True,
                       padding_value=vocab_size)
    counts = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.float32, device=device)
    if ids.shape[1]:
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def apply_penalties_(x: torch.Tensor, prompt_ids: Sequence[torch.Tensor],
                     output_ids: Sequence[torch.Tensor], repetition: Sequence[float],
                     presence: Sequence[float], frequency: Sequence[float]) -> torch.Tensor:
    """Repetition (prompt+output, HF semantics), then presence/frequency (output only).

    All sequences are per row of ``x``; callers pass only the rows that need it.
    """
    vocab = x.shape[1]
    dev = x.device
    out_counts = token_counts(output_ids, vocab)
    if any(r != 1.0 for r in repetition):
        seen = (out_counts > 0) | (token_counts(prompt_ids, vocab) > 0)
        rep = torch.tensor(repetition, dtype=torch.float32, device=dev).unsqueeze(1)
        penalised = torch.where(x > 0, x / rep, x * rep)
        x.copy_(torch.where(seen, penalised, x))
    if any(f != 0.0 for f in frequency):
        freq = torch.tensor(frequency, dtype=torch.float32, device=dev).unsqueeze(1)
        x.sub_(freq * out_counts)
    if any(p != 0.0 for p in presence):
        pres = torch.tensor(presence, dtype=torch.float32, device=dev).unsqueeze(1)
        x.sub_(pres * (out_counts > 0).to(torch.float32))
    return x


def apply_temperature_(x: torch.Tensor, temperature: Sequence[float]) -> torch.Tensor:
    """Divide each row by its temperature (callers exclude greedy rows: T > 0)."""
    if any(t != 1.0 for t in temperature):
        x.div_(torch.tensor(temperature, dtype=torch.float32, device=x.device).unsqueeze(1))
    return x


def apply_top_k_top_p_(x: torch.Tensor, top_k: Sequence[int],
                       top_p: Sequence[float]) -> torch.Tensor:
    """Mask to -inf all but the k best tokens, then all outside the top-p nucleus.

    One stable descending sort serves both; ties are broken by token id so the
    kept set is deterministic. A row always keeps at least its best token.
    """
    vocab = x.shape[1]
    use_k = any(0 < k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return x
    dev = x.device
    sorted_x, order = x.sort(dim=1, descending=True, stable=True)
    if use_k:
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev)
        pos = torch.arange(vocab, device=dev).unsqueeze(0)
        sorted_x.masked_fill_(pos >= k.unsqueeze(1), _NEG_INF)
    if use_p:
        p = torch.tensor(top_p, dtype=torch.float32, device=dev).unsqueeze(1)
        probs = sorted_x.softmax(dim=1)
        before = probs.cumsum(dim=1) - probs  # mass strictly ahead of each token
        drop = before >= p
        drop[:, 0] = False
        sorted_x.masked_fill_(drop, _NEG_INF)
    x.scatter_(1, order, sorted_x)
    return x


def apply_min_p_(x: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    if not any(m > 0.0 for m in min_p):
        return x
    probs = x.softmax(dim=1)
    m = torch.tensor(min_p, dtype=torch.float32, device=x.device).unsqueeze(1)
    threshold = m * probs.max(dim=1, keepdim=True).values
    x.masked_fill_(probs < threshold, _NEG_INF)
    return x
