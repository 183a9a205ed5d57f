"""The Hugging Face transformers baseline of the comparison scripts: load a GGUF file
(or an HF directory) with transformers, and run ``generate`` one prompt at a time,
greedy and without EOS (like ignore_eos), stamping the time of every new token.
transformers and torch are imported only here, when a script asks for the baseline."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class TimedGenerate:
    """One ``generate`` call: when it started and ended, and when each token came."""

    t0: float
    t1: float
    stamps: list[float]
    new_tokens: int

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.t0

    @property
    def decode_s(self) -> float:
        """From the first token to the end."""
        return self.t1 - self.stamps[0]


def load_hf(model_path: Path):
    """An fp32 transformers model from a .gguf file or an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if model_path.is_dir():
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                dtype=torch.float32).eval()


def generate_timed(model, prompts: list[list[int]], new_tokens: int) -> list[TimedGenerate]:
    """Batch-1 greedy ``generate`` per prompt, exactly new_tokens tokens each."""
    import torch
    from transformers import StoppingCriteriaList

    class Clock:
        """A stopping criterion that never stops; it stamps each generated token."""

        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    cfg = copy.deepcopy(model.generation_config)
    cfg.update(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=None)
    cfg.eos_token_id = None  # like ignore_eos: always new_tokens tokens
    runs = []
    for ids in prompts:
        clock, x = Clock(), torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg,
                                 stopping_criteria=StoppingCriteriaList([clock]))
        runs.append(TimedGenerate(t0, time.perf_counter(), clock.stamps, out.shape[1] - len(ids)))
    return runs
