"""Tenants keep their own prefix cache (core/kv/block_hash.py): a request's
cache salt seeds its block hashes, so the same prompt under another salt finds nothing
cached, under the same salt finds its blocks, and an unsalted request hashes exactly as
before salts existed. Tiny model, exact token counts, leak check."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from core.kv import MAX_SALT_BYTES, hash_token_blocks, root_hash
from engine.llm_engine import LLMEngine
from core.sampling import SamplingParams

SALT_A, SALT_B = b"\xaa" * 32, b"\xbb" * 32
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
                                           max_model_len=256))
    yield eng
    eng.leak_check()


def _run(eng: LLMEngine, prompt: list[int], salt: bytes) -> tuple[list[int], int]:
    """(output tokens, prompt tokens served from the prefix cache) of one request."""
    rid = eng.add_request(prompt, GREEDY, cache_salt=salt)
    tokens, cached = [], None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                cached = out.num_cached_tokens if out.finished else cached
    return tokens, cached


def test_the_same_prompt_under_another_salt_finds_nothing_cached(engine) -> None:
    engine.kv.pool.reset_prefix_cache()
    prompt = [(i * 7) % 300 + 3 for i in range(50)]  # 3 full blocks of 16 + 2 tokens
    first, cached = _run(engine, prompt, SALT_A)
    assert cached == 0
    assert _run(engine, prompt, SALT_B) == (first, 0)  # another tenant: no hit
    assert _run(engine, prompt, b"") == (first, 0)  # the shared cache is apart too
    assert _run(engine, prompt, SALT_A) == (first, 48)  # the same tenant: its 3 blocks
    assert _run(engine, prompt, b"") == (first, 48)  # unsalted requests share, as before
    engine.leak_check()


def test_a_salted_block_never_equals_an_unsalted_one() -> None:
    toks = list(range(40))
    plain = hash_token_blocks(toks, 16, seed=5)
    a, b = (hash_token_blocks(toks, 16, seed=5, salt=s) for s in (SALT_A, SALT_B))
    assert len(a) == 2 and not set(a) & set(plain) and not set(a) & set(b)
    assert hash_token_blocks(toks, 16, seed=5, salt=SALT_A, prior=a[:1]) == a


def test_unsalted_hashes_are_the_ones_tandem_always_computed() -> None:
    """Golden values from before salts existed: an open router's cache, and every
    router and worker of another version, agree on them."""
    assert root_hash(0).hex() == "dd21e1d9099d34d2fde8ec7a16c6005d8cc0d5114a0d1cd5d11981b51bac2866"
    assert [h.hex() for h in hash_token_blocks(list(range(40)), 16, seed=5)] == [
        "ecb0792181d77207b7f190e581326fcf0fa25862882b80324b014fd0c79c2429",
        "125b50ccf82976f701926b394a9bcff5b0dd0632bc08b160e82a2dc134ebf53b"]
    assert hash_token_blocks(list(range(40)), 16, seed=5, salt=b"") == \
        hash_token_blocks(list(range(40)), 16, seed=5)


def test_an_oversized_salt_is_refused_naming_the_field(engine) -> None:
    with pytest.raises(ValueError, match="^cache_salt: at most 64 bytes, got 65$"):
        engine.make_request([5, 6, 7], GREEDY, "r", cache_salt=b"x" * (MAX_SALT_BYTES + 1))
    engine.leak_check()
