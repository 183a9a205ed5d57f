"""KV policies: how much of a request's context its KV cache keeps (torch-free, so the
router checks a request's ``kv_policy`` with the same parser the engines use).

``full``: every token (the default). ``streaming:sinks=S,window=W`` (StreamingLLM,
arXiv 2309.17453): the first S tokens (attention sinks) and the most recent ones, within
a budget of S + W tokens; attention uses positions within the cache, so a request streams
far past the model's context window with a fixed KV budget. ``sinks=0`` is a plain
window over cache positions (the paper's "window attention" baseline).

The cache is paged, so a bounded policy keeps whole blocks (engine/kv_cache/policy.py
says exactly which): ``sink_blocks`` = ceil(S / block) leading blocks and
``budget_blocks - sink_blocks`` most recent ones, ``budget_blocks`` = ceil((S + W) /
block). A budget that leaves no recent block is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.errors import FieldError

KV_POLICY_KINDS = ("full", "streaming")
"""The kinds this build computes; ``h2o`` (heavy hitters) is refused by name."""


@dataclass(frozen=True)
class KVPolicy:
    """A bounded policy (``full`` is ``None`` wherever a policy is optional)."""

    kind: str
    sinks: int
    """Leading tokens always kept (the attention sinks)."""
    window: int
    """Most recent tokens kept besides the sinks."""

    @property
    def budget(self) -> int:
        """Tokens the policy keeps: sinks + window."""
        return self.sinks + self.window

    def spec(self) -> str:
        """The text this policy parses from (what a log or a handoff carries)."""
        return f"{self.kind}:sinks={self.sinks},window={self.window}"

    def sink_blocks(self, block_size: int) -> int:
        return -(-self.sinks // block_size)

    def budget_blocks(self, block_size: int) -> int:
        """Blocks the request holds at most (once its context passes the budget)."""
        return -(-self.budget // block_size)

    def recent_blocks(self, block_size: int) -> int:
        """The newest blocks kept (the block being written among them)."""
        return self.budget_blocks(block_size) - self.sink_blocks(block_size)

    def check(self, block_size: int, max_model_len: int, field: str) -> None:
        """FieldError naming ``field`` for a budget smaller than a block, one leaving no
        recent block once the sinks' blocks are kept, or one past the context window
        (positions within the cache must stay inside the model's rotary tables)."""
        if self.budget < block_size:
            raise FieldError(field, f"{field}: the budget sinks + window = {self.budget} "
                                    f"tokens is smaller than one KV block ({block_size} tokens)")
        if self.recent_blocks(block_size) < 1:
            raise FieldError(field, f"{field}: sinks={self.sinks} fill all "
                                    f"{self.budget_blocks(block_size)} blocks of the budget "
                                    f"(blocks of {block_size} tokens): raise window")
        if self.budget_blocks(block_size) * block_size > max_model_len:
            raise FieldError(field, f"{field}: the budget ({self.budget} tokens, "
                                    f"{self.budget_blocks(block_size) * block_size} in whole "
                                    f"blocks) exceeds the context window ({max_model_len})")


def parse_kv_policy(text: str, field: str = "kv_policy") -> KVPolicy | None:
    """``full`` -> None; ``streaming:sinks=S,window=W`` -> KVPolicy. FieldError naming
    ``field`` for anything else (``h2o`` is named as not computed by this build)."""
    kind, _, args = text.strip().partition(":")
    if kind == "full" and not args:
        return None
    if kind == "h2o":
        raise FieldError(field, f"{field}: h2o (heavy hitters) is not computed by this "
                                f"server; use full or streaming:sinks=S,window=W")
    if kind != "streaming":
        raise FieldError(field, f"{field} must be full or streaming:sinks=S,window=W; "
                                f"got {text!r}")
    values: dict[str, int] = {}
    for part in args.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in ("sinks", "window") or key in values \
                or not value.strip().isdigit():
            raise FieldError(field, f"{field}: {text!r} is not streaming:sinks=S,window=W "
                                    f"(S >= 0, W >= 1, whole numbers)")
        values[key] = int(value)
    if set(values) != {"sinks", "window"} or values["window"] < 1:
        raise FieldError(field, f"{field}: {text!r} needs sinks=S and window=W with W >= 1")
    return KVPolicy("streaming", values["sinks"], values["window"])
