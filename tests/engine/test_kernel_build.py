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
from engine.native import build_lock

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
