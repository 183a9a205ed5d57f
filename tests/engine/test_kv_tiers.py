"""The KV tiers below the device pool (engine/kv_cache/tiers): a prefix evicted from a
tiny device pool comes back from host memory, or from disk after a restart, and the
tokens equal a cold run's while prefill computes only the uncached tail. Corrupt and
foreign disk files are counted and recomputed, never read as KV. The tiny model with
nearly flat logits (its greedy tokens vary, so they follow the KV), the restored
blocks compared byte for byte, exact token counts, leak checks."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.kv_cache.tiers.block_file import encode
from engine.llm_engine import LLMEngine

BS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [(i * 7) % 300 + 3 for i in range(4 * BS + 5)]  # 4 full blocks + 5 tokens
FILLERS = [[(i * 11 + k * 37) % 300 + 3 for i in range(4 * BS + 5)] for k in range(3)]


def _engine(model_dir: Path, kv_dtype: str = "auto", **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(model=str(model_dir), dtype="float32",
                                            kv_cache_dtype=kv_dtype, max_model_len=128,
                                            num_kv_blocks=8, **kw))


def _host_gib(model_dir: Path, kv_dtype: str, blocks: int) -> float:
    """--kv-offload-cpu-gib that holds exactly ``blocks`` blocks of this model."""
    bb = _engine(model_dir, kv_dtype).runner.block_bytes
    return blocks * bb / (1 << 30)


def _run(eng: LLMEngine, prompt: list[int]) -> tuple[list[int], int, int]:
    """(tokens, prompt tokens served from a cache, tokens the model computed)."""
    return _run_tiers(eng, prompt)[:3]


def _run_tiers(eng: LLMEngine, prompt: list[int]) -> tuple[list[int], int, int, tuple[int, int]]:
    """_run's, and the cached tokens promoted from the (host, disk) tiers."""
    before = eng.num_computed_tokens_total
    done = eng.generate([prompt], GREEDY)[0]
    return (done.token_ids, done.num_cached_tokens, eng.num_computed_tokens_total - before,
            done.cached_by_tier)


def _prompt_blocks(eng: LLMEngine) -> torch.Tensor:
    """PROMPT's 4 full blocks as the device pool holds them now."""
    hashes = eng.kv.block_hashes(eng.make_request(PROMPT, GREEDY))[:4]
    return torch.stack([eng.runner.kv[eng.kv.pool.cached[h]] for h in hashes])


def _cold(model_dir: Path, kv_dtype: str) -> tuple[list[int], torch.Tensor]:
    """A cold run's tokens and PROMPT's blocks."""
    eng = _engine(model_dir, kv_dtype)
    tokens = _run(eng, PROMPT)[0]
    eng.leak_check()
    return tokens, _prompt_blocks(eng)


def _evict_prompt(eng: LLMEngine) -> None:
    """Run other prompts until none of PROMPT's blocks is left in the device pool."""
    for filler in FILLERS:
        _run(eng, filler)
    hashes = eng.kv.block_hashes(eng.make_request(PROMPT, GREEDY))[:4]
    assert not any(h in eng.kv.pool.cached for h in hashes)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_prefix_evicted_from_the_device_comes_back_from_host_memory(flat_model_dir, kv_dtype) -> None:
    cold, cold_blocks = _cold(flat_model_dir, kv_dtype)
    eng = _engine(flat_model_dir, kv_dtype, preemption_mode="recompute", swap_space=0,
                  kv_offload_cpu_gib=_host_gib(flat_model_dir, kv_dtype, 32))
    assert _run(eng, PROMPT) == (cold, 0, len(PROMPT) + GREEDY.max_tokens - 1)
    _evict_prompt(eng)
    tokens, cached, computed, by_tier = _run_tiers(eng, PROMPT)
    assert (tokens, cached, by_tier) == (cold, 4 * BS, (4 * BS, 0))
    assert torch.equal(_prompt_blocks(eng), cold_blocks)  # int8 codes and scales included
    assert computed == len(PROMPT) - 4 * BS + GREEDY.max_tokens - 1  # the tail and decodes
    assert eng.tiers.stats.host_hits == 4 and eng.tiers.stats.disk_hits == 0
    assert _run_tiers(eng, PROMPT)[1:4:2] == (4 * BS, (0, 0))  # on the device now
    eng.leak_check()  # device pool, tables, every host slot accounted for, no pin left


def _spilled_engine(model_dir: Path, directory: Path, kv_dtype: str = "auto") -> LLMEngine:
    """Host tier of 2 blocks, so PROMPT's blocks go on to disk."""
    return _engine(model_dir, kv_dtype, preemption_mode="recompute", swap_space=0,
                   kv_offload_cpu_gib=_host_gib(model_dir, kv_dtype, 2),
                   kv_offload_dir=str(directory), kv_offload_disk_gib=0.01)


def _write_prompt_to_disk(model_dir: Path, directory: Path, kv_dtype: str = "auto") -> None:
    eng = _spilled_engine(model_dir, directory, kv_dtype)
    _run(eng, PROMPT)
    _evict_prompt(eng)
    eng.close()  # the disk writer's queue written
    assert eng.tiers.disk.stats.written >= 4
    eng.leak_check()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_restarted_engine_serves_the_prefix_from_disk(flat_model_dir, tmp_path, kv_dtype) -> None:
    cold, cold_blocks = _cold(flat_model_dir, kv_dtype)
    _write_prompt_to_disk(flat_model_dir, tmp_path, kv_dtype)
    eng = _spilled_engine(flat_model_dir, tmp_path, kv_dtype)  # a restart: a new engine
    tokens, cached, computed, by_tier = _run_tiers(eng, PROMPT)
    assert (tokens, cached, by_tier) == (cold, 4 * BS, (0, 4 * BS))
    assert torch.equal(_prompt_blocks(eng), cold_blocks)
    assert computed == len(PROMPT) - 4 * BS + GREEDY.max_tokens - 1
    assert eng.tiers.stats.disk_hits == 4
    assert (eng.tiers.disk.stats.corrupt, eng.tiers.disk.stats.foreign) == (0, 0)
    eng.tiers.disk.close()
    eng.leak_check()


def _block_file(eng: LLMEngine, index: int) -> Path:
    hashes = eng.kv.block_hashes(eng.make_request(PROMPT, GREEDY))
    return eng.tiers.disk.path(hashes[index])


@pytest.mark.parametrize("damage", ["flip", "foreign"])
def test_a_corrupt_or_foreign_block_file_is_skipped_counted_and_recomputed(
        flat_model_dir, tmp_path, damage) -> None:
    cold, _ = _cold(flat_model_dir, "auto")
    _write_prompt_to_disk(flat_model_dir, tmp_path)
    eng = _spilled_engine(flat_model_dir, tmp_path)
    path = _block_file(eng, 1)  # the prompt's second block
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:  # intact, but written by another model
        fmt = eng.tiers.disk.fmt
        other = type(fmt)(**{**fmt.__dict__, "fingerprint": "another-model"})
        hashes = eng.kv.block_hashes(eng.make_request(PROMPT, GREEDY))
        data = encode(other, hashes[1], tuple(PROMPT[BS:2 * BS]), bytes(fmt.block_bytes))
    path.write_bytes(bytes(data))
    tokens, cached, _ = _run(eng, PROMPT)
    assert (tokens, cached) == (cold, BS)  # block 0 from disk; 1.. recomputed
    stats = eng.tiers.disk.stats
    assert (stats.corrupt, stats.foreign) == ((1, 0) if damage == "flip" else (0, 1))
    assert not path.exists() or path.read_bytes() != bytes(data)  # never kept as it was
    eng.tiers.disk.close()
    eng.leak_check()


def test_a_stopped_engine_thread_writes_its_queued_blocks_first(flat_model_dir, tmp_path,
                                                                monkeypatch) -> None:
    import asyncio
    import time

    from engine.engine_thread import EngineWorker
    from engine.kv_cache.tiers.disk import DiskTier

    real = DiskTier._write

    def slow_write(self, *args) -> None:  # a slow disk: blocks are still queued at stop
        time.sleep(0.05)
        real(self, *args)

    monkeypatch.setattr(DiskTier, "_write", slow_write)
    built = []

    async def body() -> None:
        worker = EngineWorker(lambda: built.append(_spilled_engine(flat_model_dir, tmp_path))
                              or built[0])
        await worker.start()
        for i, prompt in enumerate([PROMPT, *FILLERS]):
            q = await worker.add(await worker.make_request(prompt, GREEDY, f"r{i}"))
            while not (await asyncio.wait_for(q.get(), 60)).finished:
                pass
        worker.stop()

    asyncio.run(asyncio.wait_for(body(), 120))
    disk = built[0].tiers.disk
    assert not disk._writer.is_alive() and disk._queue.unfinished_tasks == 0
    assert disk.stats.written >= 4 and (disk.stats.dropped, disk.stats.write_errors) == (0, 0)
    assert sorted(p.name for p in tmp_path.glob("*.kvb")) == sorted(
        disk.path(h).name for h in disk.index)  # every block written, and only whole files


def test_a_disk_read_does_not_hold_up_the_step_loop(flat_model_dir, tmp_path, monkeypatch) -> None:
    """A prompt whose prefix is on disk waits in the scheduler while its blocks are read
    (here a read that waits until the test lets it go): another request keeps decoding
    meanwhile, step after step; then the prompt runs with the prefix from disk, its
    tokens equal a cold run's."""
    import threading

    from engine.kv_cache.tiers.disk import DiskTier

    cold, _ = _cold(flat_model_dir, "auto")
    _write_prompt_to_disk(flat_model_dir, tmp_path)
    eng = _spilled_engine(flat_model_dir, tmp_path)
    other = eng.add_request(FILLERS[0][:20], SamplingParams(max_tokens=20, temperature=0,
                                                            ignore_eos=True))  # 3 blocks
    eng.step()  # the other request is decoding
    real, gate, decoded_during_read = DiskTier.read, threading.Event(), []

    def gated_read(self, *args):
        gate.wait(timeout=3.0)  # released by the test, or (read on the step loop) given up
        decoded_during_read.append(len(eng.requests[other].output_token_ids))
        return real(self, *args)

    monkeypatch.setattr(DiskTier, "read", gated_read)
    rid = eng.add_request(PROMPT, GREEDY)
    before = len(eng.requests[other].output_token_ids)
    for _ in range(3):
        eng.step()
    assert len(eng.requests[other].output_token_ids) == before + 3  # it decoded each step
    assert eng.requests[rid].num_computed_tokens == 0  # the prompt waits for its blocks
    gate.set()
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert decoded_during_read and decoded_during_read[0] >= before + 2
    assert outs[rid] == cold
    assert (eng.tiers.stats.disk_hits, eng.tiers.stats.host_hits) == (4, 0)
    eng.tiers.disk.close()
    eng.leak_check()
