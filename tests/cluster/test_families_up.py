"""`tandem up --model DIR` serves a family's HF checkpoint (here Mistral, whose layers
slide, on the default attention backend and KV memory that follows the window) through
real router, prefill and decode processes: a chat completion answers with the tokens
the in-process engine produces for the same rendered prompt."""
from __future__ import annotations

import pytest

from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.cluster.launch import tandem_up
from tests.models.families import build_checkpoint
from tests.utils import write_chat_template

pytestmark = pytest.mark.slow
FAMILY = "mistral"
FLAGS = {"dtype": "float32", "quantization": "none", "max_model_len": 256}


def test_tandem_up_serves_a_family_checkpoint(tmp_path) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("transformers", reason="transformers builds the checkpoint")
    path = build_checkpoint(tmp_path / FAMILY, FAMILY)
    write_chat_template(path)
    messages = [{"role": "user", "content": "a prompt longer than the sliding window"}]

    eng = LLMEngine(EngineConfig.from_flat(model=str(path), num_kv_blocks=64, **FLAGS))
    ids = eng.tokenizer.apply_chat_template(messages, tokenize=True)
    assert len(ids) > 16  # beyond the window: the sliding layers drop keys
    want = eng.generate([ids], SamplingParams(max_tokens=12, temperature=0.0,
                                              ignore_eos=True))[0].token_ids

    args = ["--kv-transfer", "tcp", "--kv-blocks", "64", "--dtype", "float32",
            "--max-model-len", "256", "--local-prefill-threshold", "4",
            "--worker-arg=--quantization=none"]
    with tandem_up(path, args) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        got = client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 12
    assert got.choices[0].message.content == eng.tokenizer.decode(want)
