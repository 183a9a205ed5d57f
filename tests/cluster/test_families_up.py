"""`tandem up --model DIR` serves every family's HF checkpoint: a chat completion
answers with the tokens transformers generates for the same rendered prompt.

Mistral (every layer slides) runs the default layout, real router, prefill and decode
processes with KV over TCP and memory that follows the window; the other families run
`--mode colocated` (router and one engine), since each family's disaggregated tokens
are already checked against its colocated ones in process
(tests/services/test_families_disagg.py) and a third process per family cost ~10 s.
What one costs is process start-up and loading the tiny checkpoint; compilation is off
in the suite (TANDEM_COMPILE=0, tests/conftest.py). The request is short: 8 new tokens."""
from __future__ import annotations

import pytest

from core.tokenizer import Tokenizer
from tests.cluster.launch import tandem_up
from tests.models.families import FAMILIES, WINDOW, build_checkpoint, hf_greedy, load_reference
from tests.utils import write_chat_template

pytestmark = pytest.mark.slow
NEW_TOKENS = 8
MESSAGES = [{"role": "user", "content": "a prompt longer than the sliding window"}]
DISAGGREGATED = "mistral"
ARGS = ["--kv-transfer", "tcp", "--kv-blocks", "64", "--dtype", "float32",
        "--max-model-len", "256", "--local-prefill-threshold", "4",
        "--worker-arg=--quantization=none"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tandem_up_serves_a_family_checkpoint(tmp_path, family: str) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("transformers", reason="transformers builds the checkpoint")
    path = build_checkpoint(tmp_path / family, family)
    write_chat_template(path)
    tok = Tokenizer.load(path)
    ids = tok.apply_chat_template(MESSAGES, tokenize=True)
    assert len(ids) > WINDOW  # beyond the window: the sliding layers drop keys
    want = hf_greedy(load_reference(path), ids, NEW_TOKENS)

    layout = [] if family == DISAGGREGATED else ["--mode", "colocated"]
    with tandem_up(path, ARGS + layout) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        got = client.chat.completions.create(model=model, messages=MESSAGES,
                                             max_tokens=NEW_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == NEW_TOKENS
    assert got.choices[0].message.content == tok.decode(want), family
