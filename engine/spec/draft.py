"""Draft-model proposals: a smaller model sharing the tokenizer guesses k tokens, one
greedy step at a time (--speculative-model PATH), or the target's own first N layers
with its final norm and LM head (--speculative-model self:N).

Both run in the KV slots the scheduler reserved for the guesses (``in_step``), through
the target's block tables, so they need no tables of their own:
- self:N reads and writes the target's cache. The first N layers' K/V of every computed
  token are exactly what the truncated model would compute, so it has nothing to catch
  up; its writes at the guessed positions are overwritten by the verify pass.
- a separate model has its own cache tensor indexed by the same block ids. Each request
  tracks how many leading tokens have draft K/V (SpecState.draft_computed); the first
  pass of a step runs the missing ones (the whole context after an admission, a
  preemption or a KV pull; after a verification, the last accepted guess and the
  target's own token).
A guess is the draft's argmax: a point mass, which verify.py accepts losslessly.

Its ``cost`` (a guess as a fraction of a target step) is the ratio of the weights a
draft pass and a target step multiply by, LM head included: self:8 of the embedded
model's 30 layers is 0.42, its LM head (49152 x 576) weighing as much as 8 layers.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from engine.config import LoRAConfig, SpecConfig
from engine.parallel.plan import StepInputs
from engine.request import Request
from engine.spec.base import Proposer

log = logging.getLogger(__name__)


def parse_self_layers(spec: str, num_layers: int) -> int | None:
    """N of ``self:N`` (None for a path); ValueError naming the flag when out of range."""
    if not spec.startswith("self:"):
        return None
    text = spec.removeprefix("self:")
    if not text.isdigit() or not 1 <= int(text) < num_layers:
        raise ValueError(f"--speculative-model self:N needs N in [1, {num_layers}) (the "
                         f"target has {num_layers} layers), got {spec!r}")
    return int(text)


class DraftProposer(Proposer):
    in_step = True

    def __init__(self, runner, num_layers: int | None, name: str) -> None:
        """runner: what runs a draft pass (engine/model_runner.py forward_logits): the
        target's own for self:N (at --tensor-parallel-size > 1 every rank of its group
        runs the first N layers of its shard), a separate draft model's otherwise."""
        self.runner = runner
        self.num_layers = num_layers
        """self-draft: layers of the target to run; None: a separate draft model."""
        self.name = name
        self.tables: dict[str, list[int]] = {}

    @property
    def kv(self) -> torch.Tensor:
        """The cache the draft passes write (the target's own for self:N)."""
        return self.runner.kv

    @classmethod
    def create(cls, config: SpecConfig, runner, tokenizer) -> DraftProposer:
        n = parse_self_layers(config.speculative_model, runner.model_config.num_layers)
        if n is not None:
            out = cls(runner, n, "self_draft")
            out.cost = step_weights(runner.model, n) / step_weights(runner.model)
            return out
        draft = _load_draft(config, runner, tokenizer)
        log.info("draft model %s: %d layers", config.speculative_model,
                 draft.model_config.num_layers)
        out = cls(draft, None, "draft")
        out.cost = step_weights(draft.model) / step_weights(runner.model)
        return out

    def bind(self, tables: dict[str, list[int]]) -> None:
        self.tables = tables

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        lag = [self._lag(r) for r in reqs]
        inputs = [r.token_ids[s:] for r, s in zip(reqs, lag)]
        starts = list(lag)
        out: list[list[int]] = [[] for _ in reqs]
        live = list(range(len(reqs)))
        while live:
            guesses = self._pass(reqs, live, inputs, starts)
            for i, g in zip(live, guesses):
                out[i].append(g)
                starts[i] += len(inputs[i])
                inputs[i] = [g]
            live = [i for i in live if len(out[i]) < ks[i]]
        for r, k in zip(reqs, ks):
            r.spec.draft_computed = r.num_computed_tokens + k
            r.spec.draft_preemptions = r.num_preemptions
        return out

    def _lag(self, req: Request) -> int:
        """First token whose draft K/V is missing (the pending last token at the least)."""
        if self.num_layers is not None:
            return req.num_computed_tokens
        st = req.spec
        if st.draft_preemptions != req.num_preemptions:
            st.draft_computed = 0
        return min(st.draft_computed, req.num_computed_tokens)

    def _pass(self, reqs: list[Request], live: list[int], inputs: list[list[int]],
              starts: list[int]) -> list[int]:
        """One draft forward over each live row's input tokens (rows with several first,
        as the attention metadata wants); the argmax after each row's last token."""
        order = sorted(live, key=lambda i: len(inputs[i]) == 1)
        ids, pos, qlens, slens, tables, last = [], [], [], [], [], []
        for i in order:
            ids += inputs[i]
            pos += range(starts[i], starts[i] + len(inputs[i]))
            qlens.append(len(inputs[i]))
            slens.append(starts[i] + len(inputs[i]))
            tables.append(self.tables[reqs[i].request_id])
            last.append(len(ids) - 1)
        logits = self.runner.forward_logits(StepInputs(
            ids, pos, qlens, slens, sum(1 for q in qlens if q > 1), tables, last, False,
            num_layers=self.num_layers or 0))
        best = logits.argmax(dim=1).tolist()
        by_row = dict(zip(order, best))
        return [by_row[i] for i in live]


def step_weights(model, num_layers: int | None = None) -> int:
    """Weights one decode step of the first num_layers layers (all: None) and the LM
    head multiplies by."""
    layers = model.model.layers if num_layers is None else model.model.layers[:num_layers]
    return (sum(p.numel() for layer in layers for p in layer.parameters())
            + model.lm_head.weight.numel())


def _load_draft(config: SpecConfig, runner, tokenizer):
    """A second ModelRunner on the draft checkpoint, with a cache of the target's block
    count (the same block ids) and no swap pool; ValueError naming the flag when its
    vocabulary or tokenizer differs from the target's."""
    from engine.loader import load_checkpoint
    from engine.model_runner import ModelRunner
    from engine.served_model import checkpoint_tokenizer

    path = config.speculative_model
    if not Path(path).exists():
        raise ValueError(f"--speculative-model {path}: no such file or directory")
    ckpt = load_checkpoint(path)
    if ckpt.config.vocab_size != runner.model_config.vocab_size:
        raise ValueError(f"--speculative-model {path}: vocabulary of {ckpt.config.vocab_size} "
                         f"tokens, the target has {runner.model_config.vocab_size}")
    theirs = checkpoint_tokenizer(ckpt)
    if (theirs.backend.get_vocab(with_added_tokens=True)
            != tokenizer.backend.get_vocab(with_added_tokens=True)):
        raise ValueError(f"--speculative-model {path}: its tokenizer differs from the "
                         "target's (a draft must share the tokenizer)")
    target = runner.config
    cfg = replace(target, load=replace(target.load, model=path),
                  cache=replace(target.cache, num_kv_blocks=runner.num_blocks, swap_space=1e-9),
                  compilation=replace(target.compilation, compile=False), spec=SpecConfig(),
                  lora=LoRAConfig())  # a draft proposes from its own base weights
    return ModelRunner(cfg, ckpt, runner.max_model_len)
