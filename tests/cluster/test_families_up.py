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

import time

import psutil
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


def _followers() -> set[int]:
    """PIDs of the tensor-parallel ranks beyond rank 0 running on this machine."""
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if "engine.parallel.follower" in (p.info["cmdline"] or [])}


def test_tandem_up_passes_tensor_parallel_flags_to_a_pool(tmp_path) -> None:
    """`tandem up --prefill-arg=--tensor-parallel-size=2`: the prefill worker runs a group
    of two ranks (one more process), its KV reaches the TP 1 decode worker over TCP
    (every head gathered from both ranks), the answer is transformers' tokens, and
    Ctrl-C leaves no rank behind."""
    openai = pytest.importorskip("openai")
    path = build_checkpoint(tmp_path / "llama", "llama")
    write_chat_template(path)
    tok = Tokenizer.load(path)
    ids = tok.apply_chat_template(MESSAGES, tokenize=True)
    want = hf_greedy(load_reference(path), ids, NEW_TOKENS)
    before = _followers()
    with tandem_up(path, ARGS + ["--prefill-arg=--tensor-parallel-size=2"]) as url:
        assert len(_followers() - before) == 1, "the prefill worker's rank 1"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        got = client.chat.completions.create(model=client.models.list().data[0].id,
                                             messages=MESSAGES, max_tokens=NEW_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == tok.decode(want)
    assert got.usage.prompt_tokens == len(ids)
    deadline = time.monotonic() + 15  # rank 1 leaves once its rank 0 is gone
    while _followers() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _followers() - before, "a rank outlived `tandem up`"
