"""The paged decode kernel's build survives a builder killed mid-build: torch's own
build lock (a plain file) stays behind then, and torch waits for it forever, so every
later worker start hung at its first decode step with no message."""
from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest

from engine.attention import paged_decode
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.native import NativeKernel, build_lock
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
         "from engine.attention import paged_decode as p\n"
         "sys.exit(0 if p.kernel_unavailable() is None else 3)")


def test_a_stale_build_lock_does_not_hang_the_next_start() -> None:
    if paged_decode.kernel_unavailable() is not None:
        pytest.skip(f"no kernel here: {paged_decode.kernel_unavailable()}")
    stale = paged_decode.build_directory() / "lock"
    stale.touch()  # what a builder killed with SIGKILL leaves
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "left by a build that was killed" in r.stderr
    assert not stale.exists()


def test_a_live_builder_is_waited_for_then_given_up_on(tmp_path) -> None:
    with open(tmp_path / "tandem-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process building
        (tmp_path / "lock").touch()
        with pytest.raises(TimeoutError, match="building"):
            with build_lock(tmp_path, wait_s=0.5):
                pass
        assert (tmp_path / "lock").exists()  # a live builder's lock is left alone
    with build_lock(tmp_path, wait_s=0.5):
        assert not (tmp_path / "lock").exists()


def test_the_same_source_in_another_checkout_builds_apart(tmp_path) -> None:
    """ninja's build file names the source by its absolute path, so checkouts in two
    directories sharing one build directory rebuilt it for each other (about 20 s a
    start): the directory is keyed by the source's directory too."""
    copy = tmp_path / "csrc" / paged_decode.KERNEL.source.name
    copy.parent.mkdir()
    copy.write_bytes(paged_decode.KERNEL.source.read_bytes())
    other = NativeKernel("paged_decode", copy, lambda: None, without="")
    assert other.build_directory().parent == paged_decode.build_directory().parent
    assert other.build_directory() != paged_decode.build_directory()


def test_an_engine_loads_the_kernel_at_start_up_and_metrics_never_build(tiny_model_dir,
                                                                       monkeypatch) -> None:
    """The engine loads the decode kernel while it starts (a first build takes 14-25 s);
    a metrics observation reads what is known and never builds, even for a kernel not
    loaded yet (it used to build on the worker's first observed step)."""
    builds = []
    kernel = paged_decode.KERNEL
    monkeypatch.setattr(kernel, "_reason", kernel._reason)  # restored after: later tests run it
    monkeypatch.setattr(kernel, "_tried", False)
    monkeypatch.setattr(kernel, "_build", lambda: builds.append(1) or "test: not built")
    eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32",
                                           max_model_len=128, num_kv_blocks=16))
    assert builds == [1]
    monkeypatch.setattr(kernel, "_tried", False)  # as if nothing had loaded it
    metrics = WorkerMetrics("decode", "w0")
    metrics.observe_engine(eng, 0)
    assert builds == [1]
    reasons = [s for m in metrics.registry.collect() for s in m.samples
               if s.labels.get("kind") == "paged_decode"]
    assert [s.value for s in reasons] == [1.0]  # "not loaded", counted as a fallback
