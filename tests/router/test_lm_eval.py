"""lm-evaluation-harness (lm-eval) with its ``local-completions`` model, run unchanged
against a Tandem router (the router tests' tcp cluster): a multiple-choice task scored
by loglikelihood (echo + logprobs) and a generate_until task, both from local YAML +
JSONL files (tests/router/data/lm_eval). lm-eval tokenizes through the router
(/tokenizer_info, /tokenize: its remote tokenizer backend), so nothing is fetched from
a hub; each loglikelihood it reports equals an in-process forward's to 1e-3."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test dependency (pyproject dev)")

DATA = Path(__file__).parent / "data" / "lm_eval"


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    """The task YAMLs with their JSONL files' absolute paths."""
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    for f in DATA.glob("*.yaml"):
        (out / f.name).write_text(f.read_text().replace("DATA_DIR", str(DATA)))
    return out


@pytest.fixture(scope="module")
def loglikelihood(tiny_model_dir, tiny_tok):
    """Sum of the continuation's logprobs given the context, in-process, tokenized as
    lm-eval's remote tokenizer does (no special tokens)."""
    eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32",
                                           num_kv_blocks=256, max_model_len=1024))

    def run(context: str, continuation: str) -> float:
        ctx = tiny_tok.encode(context, add_special_tokens=False)
        cont = tiny_tok.encode(continuation, add_special_tokens=False)
        ids = ctx + cont
        table = eng.kv.pool.allocate(eng.kv.blocks_needed(len(ids)))
        try:
            lp = torch.log_softmax(eng.runner.prompt_logits(ids, table).float(), dim=1)
        finally:
            eng.kv.pool.free(table)
        return sum(lp[p - 1, ids[p]].item() for p in range(len(ctx), len(ids)))
    return run


def test_local_completions_scores_both_tasks(api, tasks_dir, loglikelihood, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model = api.client.models.list().data[0].id
    out = simple_evaluate(
        model="local-completions",
        model_args={"base_url": api.url + "/v1/completions", "model": model,
                    "num_concurrent": 2, "max_retries": 1, "tokenized_requests": True},
        tasks=["tandem_mc", "tandem_gen"], task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True, bootstrap_iters=0)
    results = out["results"]
    acc, em = results["tandem_mc"]["acc,none"], results["tandem_gen"]["exact_match,none"]
    assert 0.0 <= acc <= 1.0 and 0.0 <= em <= 1.0
    samples = out["samples"]["tandem_mc"]
    assert len(samples) == 3
    checked = 0
    for s in samples:
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            got = resp[0][0]
            assert abs(got - loglikelihood(context, continuation)) < 1e-3, (context, continuation)
            checked += 1
    assert checked == 8  # every choice of every question
    gens = out["samples"]["tandem_gen"]
    assert len(gens) == 2 and all(isinstance(g["resps"][0][0], str) for g in gens)
