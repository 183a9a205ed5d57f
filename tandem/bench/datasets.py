"""What the benchmark sends: synthetic prompts with controlled lengths, shared-prefix
groups, or a JSONL file of prompts.

Synthetic prompts are made of common English words, each preceded by a space.
In the byte-level BPE vocabularies of Llama-family models (SmolLM2, Llama 3,
Qwen) every such word is one token and pre-tokenization splits at the spaces,
so a prompt of N words is N prompt tokens on the server; the text works against
any OpenAI-compatible endpoint (no token ids on the wire).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# One token each (with the leading space) in the SmolLM2 / Llama BPE vocabularies.
WORDS = tuple("""time year people way day man thing woman life child world school state
family student group country problem hand part place case week company system program
question work government number night point home water room mother area money story fact
month lot right study book eye job word business issue side kind head house service friend
father power hour game line end member law car city community name president team minute
idea kid body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force
education""".split())


@dataclass(frozen=True)
class BenchRequest:
    """One request of a benchmark run."""

    prompt: str
    """Completion prompt text (sent as is; with --chat, as the user message)."""
    prompt_len: int
    """Prompt length in tokens as built (synthetic) or as given in the file (0 = unknown)."""
    max_tokens: int
    """Tokens to generate (sent with ignore_eos so the server produces exactly this many)."""
    tag: str = ""
    """Workload class, for mixed workloads (e.g. 'short', 'long'); stats can filter on it."""
    group: int | None = None
    """Shared-prefix group index, or None."""


@dataclass(frozen=True)
class LengthDist:
    """A distribution of lengths: fixed:N, uniform:LO:HI or normal:MEAN:STD (>= 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        """'128' or 'fixed:128', 'uniform:64:256', 'normal:128:32'."""
        parts = str(spec).split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(parts[0]))
            kind, nums = parts[0], [float(x) for x in parts[1:]]
        except ValueError:
            raise ValueError(f"length distribution {spec!r}: numbers expected") from None
        want = {"fixed": 1, "uniform": 2, "normal": 2}
        if kind not in want or len(nums) != want[kind]:
            raise ValueError(f"length distribution {spec!r}: use fixed:N, uniform:LO:HI "
                             "or normal:MEAN:STD")
        if kind == "uniform" and nums[0] > nums[1]:
            raise ValueError(f"length distribution {spec!r}: LO must be <= HI")
        return cls(kind, *nums)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        else:
            x = rng.gauss(self.a, self.b)
        return max(1, int(round(x)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{int(self.a)}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def words(n: int, rng: random.Random) -> str:
    """n random one-token words, each with its leading space."""
    return "".join(" " + rng.choice(WORDS) for _ in range(n))


def synthetic(n: int, input_len: LengthDist, output_len: LengthDist, *, seed: int = 0,
              prefix_groups: int = 0, prefix_len: int = 0, tag: str = "") -> list[BenchRequest]:
    """n requests. With prefix_groups > 0 every request starts with one of that many
    shared prefixes of prefix_len tokens (request i uses group i % prefix_groups) and
    input_len is the length of its own suffix; the prompt is prefix + suffix."""
    if n < 0:
        raise ValueError(f"number of prompts must be >= 0, got {n}")
    if prefix_groups < 0 or prefix_len < 0:
        raise ValueError("--prefix-groups and --prefix-len must be >= 0")
    if prefix_groups and not prefix_len:
        raise ValueError("--prefix-groups needs --prefix-len > 0")
    rng = random.Random(seed)
    # A distinct first word per group, so that no two groups share even one block.
    prefixes = [" " + WORDS[g % len(WORDS)] + words(prefix_len - 1, rng)
                for g in range(prefix_groups)]
    out = []
    for i in range(n):
        suffix_len, max_tokens = input_len.sample(rng), output_len.sample(rng)
        if prefix_groups:
            g = i % prefix_groups
            out.append(BenchRequest(prefixes[g] + words(suffix_len, rng), prefix_len + suffix_len,
                                    max_tokens, tag, g))
        else:
            out.append(BenchRequest(words(suffix_len, rng), suffix_len, max_tokens, tag))
    return out


def from_jsonl(path: str | Path, default_max_tokens: int = 128, limit: int | None = None
               ) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": str, "max_tokens": int (optional)}."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f'{path}:{lineno}: expected {{"prompt": str, "max_tokens": int}}')
            max_tokens = int(obj.get("max_tokens") or default_max_tokens)
            if max_tokens < 1:
                raise ValueError(f"{path}:{lineno}: max_tokens must be >= 1")
            out.append(BenchRequest(obj["prompt"], int(obj.get("prompt_len", 0)), max_tokens,
                                    str(obj.get("tag", ""))))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out
