"""Summary statistics of a run: latency percentiles, throughput and goodput.

Goodput (DistServe's definition) is the rate of requests that completed *and* met
every SLO given: TTFT <= --slo-ttft and TPOT <= --slo-tpot. A one-token output
has no TPOT and meets the TPOT SLO trivially.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from tandem.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile with linear interpolation between closest ranks (numpy's
    default): position (n - 1) * p / 100 in the sorted values. None when empty."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * p / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ideal_cached_tokens(prompt: Sequence[int], earlier: Iterable[Sequence[int]],
                        block: int) -> int:
    """The prompt tokens one unbounded prefix cache could serve, having computed the
    ``earlier`` sequences: the whole blocks of the longest common prefix with any of
    them, never the prompt's last token (it is computed for its logits)."""
    best = 0
    for seen in earlier:
        n = 0
        for a, b in zip(prompt, seen):
            if a != b:
                break
            n += 1
        best = max(best, min(n, len(prompt) - 1) // block * block)
    return best


@dataclass(frozen=True)
class Dist:
    """Mean and percentiles of one latency, in seconds (None when no samples)."""

    n: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Dist:
        xs = [v for v in values if v is not None]
        if not xs:
            return cls(0, None, None, None, None, None)
        return cls(len(xs), sum(xs) / len(xs), percentile(xs, 50), percentile(xs, 90),
                   percentile(xs, 99), max(xs))


def meets_slo(r: RequestResult, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    """Completed and within every SLO given (seconds)."""
    if not r.ok:
        return False
    if slo_ttft is not None and (r.ttft is None or r.ttft > slo_ttft):
        return False
    tpot = r.tpot
    return slo_tpot is None or tpot is None or tpot <= slo_tpot


@dataclass(frozen=True)
class Summary:
    """What one run measured. Throughputs are per second of the run's wall time."""

    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float
    """Completed requests / duration."""
    output_throughput: float
    """Generated tokens of completed requests / duration."""
    total_token_throughput: float
    """(Prompt + generated tokens) of completed requests / duration."""
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist
    slo_ttft: float | None
    slo_tpot: float | None
    good: int
    """Completed requests that met every SLO."""
    goodput: float
    """good / duration (req/s)."""
    goodput_tokens: float
    """Generated tokens of the good requests / duration (tok/s)."""

    @property
    def slo_attainment(self) -> float:
        total = self.completed + self.failed
        return self.good / total if total else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["slo_attainment"] = self.slo_attainment
        return d


def summarize(results: Sequence[RequestResult], duration_s: float, *,
              slo_ttft: float | None = None, slo_tpot: float | None = None,
              tag: str | None = None) -> Summary:
    """Summarize a run; with ``tag`` only the requests of that workload class count
    (the duration stays the whole run's)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    rs = [r for r in results if tag is None or r.request.tag == tag]
    ok = [r for r in rs if r.ok]
    good = [r for r in ok if meets_slo(r, slo_ttft, slo_tpot)]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    return Summary(
        completed=len(ok), failed=len(rs) - len(ok), duration_s=duration_s,
        prompt_tokens=prompt, output_tokens=output,
        request_throughput=len(ok) / duration_s, output_throughput=output / duration_s,
        total_token_throughput=(prompt + output) / duration_s,
        ttft=Dist.of(r.ttft for r in ok), tpot=Dist.of(r.tpot for r in ok),
        itl=Dist.of(x for r in ok for x in r.itls), e2e=Dist.of(r.e2e for r in ok),
        slo_ttft=slo_ttft, slo_tpot=slo_tpot, good=len(good),
        goodput=len(good) / duration_s,
        goodput_tokens=sum(r.output_tokens for r in good) / duration_s)
