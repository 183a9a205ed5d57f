"""Proto <-> core value conversions: sampling parameters, logprobs, the enums of the
states that cross a link (``WireEnum``), and the field a client's error names
(``field_error_trailer``).

Hand-written beside the generated code: the values are core's (torch-free), so both
sides of a link use one conversion, the router (which fills the requests) and the
workers (which read them). KV events and load reports are the workers' own
(worker/events.py, worker/base.py); the engine itself knows no proto."""
from __future__ import annotations

from enum import Enum
from typing import Generic, Iterable, TypeVar

from google.protobuf.any_pb2 import Any
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper
from google.rpc import code_pb2, error_details_pb2, status_pb2

from core.errors import FieldError
from core.guided.spec import GuidedSpec
from core.sampling import SamplingParams
from core.states import FallbackReason
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
        speculate=m.speculate if m.HasField("speculate") else True,
        min_tokens=m.min_tokens,
        logit_bias=tuple((b.token_id, b.bias) for b in m.logit_bias),
        allowed_token_ids=tuple(m.allowed_token_ids) or None,
        bad_words_token_ids=tuple(tuple(w.ids) for w in m.bad_words),
        include_stop_str_in_output=m.include_stop_str_in_output,
        skip_special_tokens=(m.skip_special_tokens if m.HasField("skip_special_tokens")
                             else True),
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        n=m.n or 1)


def sampling_to_proto(p: SamplingParams) -> common.SamplingParams:
    m = common.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        min_p=p.min_p, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, stop=list(p.stop),
        min_tokens=p.min_tokens,
        logit_bias=[common.TokenBias(token_id=t, bias=v) for t, v in p.logit_bias],
        allowed_token_ids=list(p.allowed_token_ids or ()),
        bad_words=[common.TokenIds(ids=list(w)) for w in p.bad_words_token_ids],
        include_stop_str_in_output=p.include_stop_str_in_output)
    if p.n != 1:
        m.n = p.n
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.guided is not None:
        m.guided.kind, m.guided.text = p.guided.kind, p.guided.text
    if not p.speculate:
        m.speculate = False
    if not p.skip_special_tokens:
        m.skip_special_tokens = False
    return m


def top_to_proto(top: list[tuple[int, float]]) -> common.TopLogprobs:
    """The top-N (token id, logprob) pairs of one position."""
    return common.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def top_from_proto(m: common.TopLogprobs) -> list[tuple[int, float]]:
    return list(zip(m.token_ids, m.logprobs))


def prompt_logprobs_to_proto(lps: Iterable) -> common.PromptLogprobs:
    """A prompt's logprobs (each with .logprob and .top: engine TokenLogprobs)."""
    lps = list(lps)
    m = common.PromptLogprobs(logprobs=[lp.logprob for lp in lps])
    if any(lp.top for lp in lps):
        m.top.extend(top_to_proto(lp.top) for lp in lps)
    return m


def prompt_logprobs_from_proto(m: common.PromptLogprobs
                               ) -> list[tuple[float, list[tuple[int, float]]]]:
    """[(logprob, top-N pairs)] per prompt token after the first."""
    tops = [top_from_proto(t) for t in m.top]
    return [(lp, tops[i] if i < len(tops) else []) for i, lp in enumerate(m.logprobs)]


STATUS_DETAILS_KEY = "grpc-status-details-bin"
"""The trailer of gRPC's rich error model: a google.rpc.Status, which grpcio-status
and every other language's gRPC read. Written here in a few lines rather than with
grpcio-status, which would pin protobuf for two functions."""


def field_error_trailer(e: FieldError) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata of an INVALID_ARGUMENT for a client's error: a Status whose
    google.rpc.BadRequest names the field, so no caller parses the message for it."""
    violation = error_details_pb2.BadRequest.FieldViolation(field=e.field, description=str(e))
    detail = Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(e), details=[detail])
    return ((STATUS_DETAILS_KEY, status.SerializeToString()),)


def field_of(trailers: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The field a peer's error named (``field_error_trailer``), or None."""
    for key, value in trailers or ():
        if key != STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        for detail in status_pb2.Status.FromString(value).details:
            bad = error_details_pb2.BadRequest()
            if detail.Unpack(bad) and bad.field_violations:
                return bad.field_violations[0].field
    return None
