"""What of the prompt goes back with a response: OpenAI's echo on /v1/completions (the
prompt's text before the completion and, with logprobs, its tokens in the logprobs
object: the first token's logprob and top_logprobs null, as OpenAI has them) and vLLM's
prompt_logprobs (a list, null first, then per prompt token a dict keyed by token id of
{logprob, rank, decoded_token}: the token itself and the top K at its position).

The workers compute the prompt's logprobs during prefill (the top max(N, K) at each
position, SamplingParams.prompt_logprobs); each rendering keeps its own count.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.tokenizer import Tokenizer
from router.flow import Logprob


@dataclass(frozen=True)
class PromptPart:
    tokenizer: Tokenizer
    ids: list[int]
    """The prompt's token ids, as the workers ran it."""
    echo: str | None = None
    """completions' echo: the prompt's text, sent before the completion's; None: no echo."""
    echo_top: int | None = None
    """With echo and logprobs N: the prompt's tokens lead the logprobs object, N
    alternatives each; None: they do not."""
    top: int | None = None
    """vLLM's prompt_logprobs K: the response carries them; None: it does not."""

    @classmethod
    def of(cls, tokenizer: Tokenizer, intake) -> PromptPart | None:
        """From an Intake (router/http/intake.py); None when nothing of the prompt goes
        back."""
        if intake.echo is None and intake.prompt_logprobs is None:
            return None
        return cls(tokenizer, intake.prompt_ids, intake.echo,
                   intake.logprobs if intake.echo is not None else None,
                   intake.prompt_logprobs)

    def text(self, text: str, opening: bool) -> str:
        """The choice's text (its first piece, when streamed, leads with the echo)."""
        return self.echo + text if self.echo is not None and opening else text

    def logprobs(self, ids: list[int], lps: list[Logprob], prompt: list[Logprob] | None,
                 opening: bool) -> tuple[list[int], list[Logprob | None]]:
        """The tokens and logprobs the logprobs object lists: the prompt's first (the
        first with none), when echoed, on the opening piece."""
        if self.echo_top is None or not opening:
            return ids, list(lps)
        n = self.echo_top
        mine = [(lp, top[:n]) for lp, top in (prompt or [])]
        mine += [None] * (len(self.ids) - 1 - len(mine))  # never short; if so, null
        return self.ids + ids, [None, *mine, *lps]

    def vllm(self, prompt: list[Logprob] | None) -> list[dict | None] | None:
        """vLLM's prompt_logprobs list; None when not asked for. rank is the token's place
        in the top K (1 = most likely), null when it is not among them."""
        if self.top is None:
            return None
        out: list[dict | None] = [None]
        for t, (lp, top) in zip(self.ids[1:], prompt or []):
            top = top[:self.top]
            ranks = {alt: i + 1 for i, (alt, _) in enumerate(top)}
            entry = {str(t): self._entry(lp, ranks.get(t), t)}
            for alt, alp in top:
                entry.setdefault(str(alt), self._entry(alp, ranks[alt], alt))
            out.append(entry)
        return out

    def _entry(self, lp: float, rank: int | None, token: int) -> dict:
        return {"logprob": lp, "rank": rank,
                "decoded_token": self.tokenizer.decode([token], skip_special_tokens=False)}
