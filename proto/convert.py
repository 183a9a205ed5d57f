"""Proto <-> core value conversions: sampling parameters and logprobs.

Hand-written beside the generated code: the values are core's (torch-free), so both
sides of a link use one conversion, the router (which fills the requests) and the
workers (which read them). KV events and load reports are the workers' own
(worker/events.py, worker/base.py); the engine itself knows no proto."""
from __future__ import annotations

from core.guided.spec import GuidedSpec
from core.sampling import SamplingParams
from proto import common_pb2 as common


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


def top_to_proto(top: list[tuple[int, float]]) -> common.TopLogprobs:
    """The top-N (token id, logprob) pairs of one position."""
    return common.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def top_from_proto(m: common.TopLogprobs) -> list[tuple[int, float]]:
    return list(zip(m.token_ids, m.logprobs))
