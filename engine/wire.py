"""Proto <-> engine value conversions: sampling parameters, logprobs, KV events, and
the enums of the states that cross a link (``WireEnum``).

Torch-free and model-free, so both sides of a link import them: the router (which
fills the requests) and the workers (which read them). Load reports are the
workers' own (worker/base.py)."""
from __future__ import annotations

from enum import Enum
from typing import Generic, TypeVar

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from engine.guided.spec import GuidedSpec
from engine.kv_cache import KVEvent, KVEventKind
from engine.sampling import SamplingParams
from engine.states import FallbackReason
from proto import common_pb2 as common
from proto import decode_pb2

E = TypeVar("E", bound=Enum)


class WireEnum(Generic[E]):
    """A Python enum and its proto twin, paired by name (proto name = prefix + member
    name; building the pair fails at import when a member has no twin). The proto's
    0 (..._UNSPECIFIED: "none", or "no answer") is None here, and so is a value newer
    than this process knows, which reads as no answer too."""

    def __init__(self, members: type[E], wire: EnumTypeWrapper, prefix: str) -> None:
        self._to = {m: wire.Value(prefix + m.name) for m in members}
        self._from = {v: m for m, v in self._to.items()}

    def to_proto(self, member: E | None) -> int:
        return 0 if member is None else self._to[member]

    def from_proto(self, value: int) -> E | None:
        return self._from.get(value)


FALLBACK = WireEnum(FallbackReason, decode_pb2.FallbackReason, "FALLBACK_")
"""KVTrace.fallback."""


def sampling_from_proto(m: common.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the field (the caller answers INVALID_ARGUMENT)."""
    return SamplingParams(
        max_tokens=m.max_tokens, temperature=m.temperature, top_k=m.top_k,
        top_p=m.top_p if m.top_p else 1.0, min_p=m.min_p,
        repetition_penalty=m.repetition_penalty if m.repetition_penalty else 1.0,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        seed=m.seed if m.HasField("seed") else None, stop=tuple(m.stop),
        stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        guided=GuidedSpec(m.guided.kind, m.guided.text) if m.HasField("guided") else None,
        speculate=m.speculate if m.HasField("speculate") else True)


def sampling_to_proto(p: SamplingParams) -> common.SamplingParams:
    m = common.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        min_p=p.min_p, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, stop=list(p.stop))
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.guided is not None:
        m.guided.kind, m.guided.text = p.guided.kind, p.guided.text
    if not p.speculate:
        m.speculate = False
    return m


def events_to_proto(events: list[KVEvent]) -> list[common.KVEvent]:
    kinds = {KVEventKind.STORED: common.KVEvent.STORED, KVEventKind.REMOVED: common.KVEvent.REMOVED}
    return [common.KVEvent(kind=kinds[e.kind], block_hash=e.block_hash) for e in events]


def top_to_proto(top: list[tuple[int, float]]) -> common.TopLogprobs:
    """The top-N (token id, logprob) pairs of one position."""
    return common.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def top_from_proto(m: common.TopLogprobs) -> list[tuple[int, float]]:
    return list(zip(m.token_ids, m.logprobs))

