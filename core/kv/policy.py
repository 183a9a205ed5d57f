"""KV policies: how much of a request's context its KV cache keeps (torch-free, so the
router checks a request's ``kv_policy`` with the same parser the engines use).

``full``: every token (the default). ``streaming:sinks=S,window=W`` (StreamingLLM,
arXiv 2309.17453): the first S tokens (attention sinks) and the most recent ones, within
a budget of S + W tokens; attention uses positions within the cache, so a request streams
far past the model's context window with a fixed KV budget. ``sinks=0`` is a plain
window over cache positions (the paper's "window attention" baseline).
``h2o:heavy=H,recent=R`` (H2O, arXiv 2306.14048): the R most recent tokens (the one
being computed among them) and the H "heavy hitters" with the largest attention mass
accumulated so far, chosen per layer and KV head, token by token
(engine/kv_cache/h2o.py); positions within the cache as for streaming. With
``,halflife=T`` the accumulated attention fades by half every T tokens (A2SF, arXiv
2407.20485: a forgetting factor), so tokens that stopped drawing attention can leave the
heavy part; without it, the paper's plain sums. With ``,score=mean`` a token is ranked
by its accumulated attention per query it has seen (under a halflife, per faded query)
instead of by the sum, so an old token's long history does not outweigh a younger one's
stronger draw. With ``,sinks=S`` the first S tokens are kept besides (StreamingLLM's
attention sinks, which plain H2O may evict in some heads).

The cache is paged, so a bounded policy keeps whole blocks (engine/kv_cache/policy.py
says exactly which): ``sink_blocks`` = ceil(S / block) leading blocks and
``budget_blocks - sink_blocks`` most recent ones, ``budget_blocks`` = ceil((S + W) /
block). A budget that leaves no recent block is refused. ``h2o`` keeps tokens, not
blocks: its ``budget`` tokens fill ``budget_blocks`` blocks, compacted.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.errors import FieldError

KV_POLICY_KINDS = ("full", "streaming", "h2o")
_ARGS = {"streaming": ("sinks", "window"), "h2o": ("heavy", "recent")}
_OPTIONAL = {"streaming": (), "h2o": ("sinks", "halflife", "score")}
_LETTER = {"sinks": "S", "window": "W", "heavy": "H", "recent": "R", "halflife": "T",
           "score": "mean"}
_WORDS = {"score": ("sum", "mean")}
"""The arguments that take a word, not a whole number: their choices, the default first."""
_FORMS = ("full, streaming:sinks=S,window=W or "
          "h2o:heavy=H,recent=R[,sinks=S][,halflife=T][,score=mean]")


@dataclass(frozen=True)
class KVPolicy:
    """A bounded policy (``full`` is ``None`` wherever a policy is optional)."""

    kind: str
    sinks: int
    """Leading tokens always kept (the attention sinks; h2o: none unless asked)."""
    window: int
    """Most recent tokens kept besides the sinks."""
    heavy: int = 0
    """h2o: tokens kept for their accumulated attention (the heavy hitters)."""
    recent: int = 0
    """h2o: most recent tokens kept (the one being computed included)."""
    halflife: int = 0
    """h2o: tokens over which accumulated attention fades by half; 0: plain sums."""
    score: str = "sum"
    """h2o: what ranks a heavy candidate for eviction: ``sum`` (the accumulated attention,
    the paper's) or ``mean`` (that divided by the queries the token has seen)."""

    @property
    def budget(self) -> int:
        """Tokens the policy keeps: sinks + window, or heavy + recent."""
        return self.sinks + self.window + self.heavy + self.recent

    @property
    def scored(self) -> bool:
        """Whether attention must give this policy's requests their scores (h2o)."""
        return self.kind == "h2o"

    def spec(self) -> str:
        """The text this policy parses from (what a log or a handoff carries)."""
        names = _ARGS[self.kind] + tuple(k for k in _OPTIONAL[self.kind]
                                         if getattr(self, k) != _default(k))
        return f"{self.kind}:" + ",".join(f"{k}={getattr(self, k)}" for k in names)

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
            names = " + ".join(k for k in ("sinks", "window", "heavy", "recent")
                               if k in _ARGS[self.kind] or getattr(self, k))
            raise FieldError(field, f"{field}: the budget {names} = {self.budget} "
                                    f"tokens is smaller than one KV block ({block_size} tokens)")
        if not self.scored and self.recent_blocks(block_size) < 1:
            raise FieldError(field, f"{field}: sinks={self.sinks} fill all "
                                    f"{self.budget_blocks(block_size)} blocks of the budget "
                                    f"(blocks of {block_size} tokens): raise window")
        if self.budget_blocks(block_size) * block_size > max_model_len:
            raise FieldError(field, f"{field}: the budget ({self.budget} tokens, "
                                    f"{self.budget_blocks(block_size) * block_size} in whole "
                                    f"blocks) exceeds the context window ({max_model_len})")


def _default(name: str) -> int | str:
    """An optional argument's value when the spec leaves it out."""
    return _WORDS[name][0] if name in _WORDS else 0


def decay_per_token(halflife: int) -> float:
    """h2o: the factor accumulated attention fades by per token (1.0 for halflife 0)."""
    return 0.5 ** (1 / halflife) if halflife else 1.0


def parse_kv_policy(text: str, field: str = "kv_policy") -> KVPolicy | None:
    """``full`` -> None; ``streaming:sinks=S,window=W`` or ``h2o:heavy=H,recent=R`` (optionally
    ``,sinks=S``, ``,halflife=T`` and ``,score=sum|mean``) -> KVPolicy. FieldError naming
    ``field`` for anything else."""
    kind, _, args = text.strip().partition(":")
    if kind == "full" and not args:
        return None
    if kind not in _ARGS:
        raise FieldError(field, f"{field} must be {_FORMS}; got {text!r}")
    names, optional = _ARGS[kind], _OPTIONAL[kind]
    form = f"{kind}:" + ",".join(f"{k}={_LETTER[k]}" for k in names)
    form += "".join(f"[,{k}={_LETTER[k]}]" for k in optional)
    values: dict[str, int] = {}
    words: dict[str, str] = {}
    for part in args.split(","):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or key not in names + optional or key in values or key in words:
            raise FieldError(field, f"{field}: {text!r} is not {form} (whole numbers)")
        if key in _WORDS:
            if value not in _WORDS[key]:
                raise FieldError(field, f"{field}: {key} must be "
                                        f"{' or '.join(_WORDS[key])}; got {value!r}")
            words[key] = value
        elif value.isdigit():
            values[key] = int(value)
        else:
            raise FieldError(field, f"{field}: {text!r} is not {form} (whole numbers)")
    least = {"sinks": 0, "window": 1, "heavy": 1, "recent": 1, "halflife": 1}
    if not set(names) <= set(values) or any(values[k] < least[k] for k in values):
        bounds = ", ".join(f"{k} >= {least[k]}" for k in names + optional if k in least)
        raise FieldError(field, f"{field}: {text!r} needs {names[0]} and {names[1]}, {bounds}")
    if kind == "h2o":
        return KVPolicy(kind, values.get("sinks", 0), 0, values["heavy"], values["recent"],
                        values.get("halflife", 0), words.get("score", "sum"))
    return KVPolicy(kind, values["sinks"], values["window"])
