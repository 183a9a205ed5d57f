"""User-caused errors: a clear message naming the field or file, and an engine
that keeps serving its other requests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineConfig
from core.limits import check_prompt
from engine.llm_engine import LLMEngine
from engine.loader import load_checkpoint
from core.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
                                            max_model_len=128))


def test_unknown_model_path_and_format(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_checkpoint(tmp_path / "does-not-exist")
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="unknown model format.*weights.bin"):
        load_checkpoint(bad)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="fake.gguf"):
        load_checkpoint(fake)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(empty)


def test_unsupported_gguf_tensor_type_is_named(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "q5.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, val in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                     ("context_length", 64), ("attention.head_count", 2),
                     ("attention.head_count_kv", 2)):
        w.add_uint32(f"llama.{key}", val)
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    # a Q5_0 weight: 32 values per 22-byte block
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 22), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q5_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*Q5_0.*supported: F32"):
        load_checkpoint(path)


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": -1}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"logprobs": 50}, "logprobs"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"n": 2, "max_tokens": 0}, "n"),
])
def test_sampling_values_are_checked(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_rejected_while_others_run(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    good = engine.add_request("hello there", params)
    engine.step()
    with pytest.raises(ValueError, match="context window"):
        engine.add_request("x" * 500, params)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 99999], params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("again", params, request_id=good)
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [good]
    assert finished[0].num_output_tokens == 5
    engine.leak_check()


class _Ids(list):
    """Token ids that count how many of them were read."""

    read = 0

    def __iter__(self):
        for t in super().__iter__():
            _Ids.read += 1
            yield t


def test_an_oversized_prompt_is_refused_before_its_ids_are_read() -> None:
    """A worker checks a prompt on its event loop: a million ids past the context
    window cost one length check, not a million (gRPC takes 4 MB of them)."""
    _Ids.read = 0
    with pytest.raises(ValueError, match="^prompt has 1000000 tokens; the context window"):
        check_prompt(_Ids([5] * 1_000_000), 320, 128)
    assert _Ids.read == 0
    check_prompt(_Ids([5] * 100), 320, 128)
    assert _Ids.read == 100


def test_generation_stops_at_context_window(engine: LLMEngine) -> None:
    ids = [5] * 120
    out = engine.generate([ids], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and out.finish_reason.value == "length"
    engine.leak_check()


def test_config_errors_name_the_flag(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="--block-size"):
        EngineConfig.from_flat(block_size=12)
    with pytest.raises(ValueError, match="--dtype"):
        EngineConfig.from_flat(dtype="float8")
    with pytest.raises(ValueError, match="--kv-blocks"):
        LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), num_kv_blocks=2, max_model_len=128))
