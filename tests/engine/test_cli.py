"""The tandem CLI as a user runs it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.fetch_model import DEFAULT_MODEL, cache_dir, is_valid

TANDEM = [sys.executable, "-m", "tandem.cli"]


def test_generate_prints_only_the_completion(tiny_model_dir: Path) -> None:
    args = ["generate", "hello", "--model", str(tiny_model_dir), "--max-tokens", "6",
            "--dtype", "float32"]
    a = subprocess.run(TANDEM + args, capture_output=True, text=True, timeout=120)
    assert a.returncode == 0, a.stderr
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from core.sampling import SamplingParams
    eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64))
    want = eng.generate(["hello"], SamplingParams(max_tokens=6, temperature=0))[0].text
    assert a.stdout == want + "\n"


def test_generate_errors_are_one_clear_line(tmp_path: Path) -> None:
    r = subprocess.run(TANDEM + ["generate", "hi", "--model", str(tmp_path / "nope.gguf")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--model" in r.stderr and "nope.gguf" in r.stderr
    assert "Traceback" not in r.stderr


def test_fetch_model_is_idempotent_and_verified(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    assert cache_dir("/x/y") == Path("/x/y")
    bad = tmp_path / DEFAULT_MODEL.filename
    bad.write_bytes(b"truncated")
    assert not is_valid(bad)
    real = Path.home() / ".cache" / "tandem" / DEFAULT_MODEL.filename
    if not real.exists():
        pytest.skip("default model not fetched")
    r = subprocess.run(TANDEM + ["fetch-model", "--cache-dir", str(real.parent)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "already present" in r.stderr
    assert r.stdout.strip() == str(real)
