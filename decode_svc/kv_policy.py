"""A kv_handle made under a bounded KV policy (core/kv/policy.py), as the decode side
adopts it: the prefill side ran the prompt under the request's policy, so the handle
lists only the blocks it kept (``block_index`` says which table entries they are), at
positions within the cache (their keys re-rotated as earlier blocks were dropped), and,
under h2o, the attention scores its next evictions follow.

The decode worker adopts it only under the same policy: its scheduler lays the request's
table out as the prefill side's last query left it (engine/scheduler.py
``_admit_external``), so the kept blocks land at the same entries with the same hole, and
the next step drops and re-rotates exactly as a colocated engine's would.
"""
from __future__ import annotations

import math

import torch

from core.kv import blocks_for
from engine.config import dtype_name
from engine.request import Request
from kvtransfer.base import SourceBlocks
from proto import kv_link_pb2


def policy_mismatch(req: Request, handle: kv_link_pb2.KVHandle) -> str | None:
    """Why the handle's KV cannot be adopted by req (kept blocks and scores mean something
    only under the policy they were made under); None when it can."""
    mine = req.kv_policy.spec() if req.kv_policy is not None else "full"
    theirs = handle.kv_policy or "full"
    if theirs != mine:
        return (f"kv_handle.kv_policy: the KV was computed under {theirs}, and request "
                f"{req.request_id} runs under kv_policy {mine}; send both halves the same "
                "kv_policy")
    return None


def adopt_scores(req: Request, handle: kv_link_pb2.KVHandle, layers: int,
                 kv_heads: int) -> str | None:
    """Under h2o, give req the handle's scores [layers, KV heads, budget] (the engine
    moves them to its device when it first adds to them), and under score=mean its
    arrivals of that shape, each a token index up to the handle's num_tokens; the reason
    when they are not so (or present without score=mean). Other policies carry none."""
    policy = req.kv_policy
    if policy is None or not policy.scored:
        return None
    shape = (layers, kv_heads, policy.budget)
    fields = [("kv_scores", handle.kv_scores, torch.float32)]
    if policy.score == "mean":
        fields.append(("kv_arrivals", handle.kv_arrivals, torch.int32))
    elif handle.kv_arrivals:
        return (f"kv_handle.kv_arrivals: {len(handle.kv_arrivals)} bytes under kv_policy "
                f"{policy.spec()}, which keeps none (only score=mean does)")
    got = {}
    for name, data, dtype in fields:
        size = dtype.itemsize * math.prod(shape)
        if len(data) != size:
            return (f"kv_handle.{name}: {len(data)} bytes, not {dtype_name(dtype)} "
                    f"{list(shape)} ({size} bytes) as kv_policy {policy.spec()} needs")
        got[name] = torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
    arrivals = got.get("kv_arrivals")
    if arrivals is not None:
        lo, hi = int(arrivals.min()), int(arrivals.max())
        if not 0 <= lo <= hi <= handle.num_tokens:  # the last slot's: the KV's next token
            return (f"kv_handle.kv_arrivals: token indices {lo}..{hi}, outside "
                    f"0..num_tokens ({handle.num_tokens})")
    req.kv_scores, req.kv_arrivals = got["kv_scores"], arrivals
    return None


def entries_mismatch(handle: SourceBlocks, block_size: int) -> str | None:
    """Why the handle's blocks cannot cover its num_tokens (every entry, or with
    ``block_index`` a strictly increasing subset of them); None when they can."""
    want = blocks_for(handle.num_tokens, block_size)
    index = handle.block_index
    if not index and len(handle.block_ids) == want:
        return None
    if (index and len(index) == len(handle.block_ids) and index[-1] < want
            and all(a < b for a, b in zip(index, index[1:]))):
        return None
    return (f"kv_handle: {len(handle.block_ids)} block_ids (block_index "
            f"{list(index[:8])}) for num_tokens {handle.num_tokens} (expected {want} "
            "entries, or block_index naming increasing entries below that)")
