"""A secret or key file a user gets wrong stops the process at start-up with exit
status 2 and one line naming the flag, the file and what is wrong (never a traceback,
never a worker that starts and then refuses everyone)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _start(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_CLUSTER_SECRET"}
    env.update(PYTHONPATH=str(ROOT), TANDEM_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "tandem.cli", *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=120)


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
@pytest.mark.parametrize("content, expected", [
    (None, "cannot read it (No such file or directory)"),
    (b"short", "the cluster secret is too short (5 bytes; at least 16)"),
])
def test_a_bad_cluster_secret_file_is_a_startup_error(tmp_path, role, content, expected) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
        path.chmod(0o600)
    extra = ["--decode", "127.0.0.1:1"] if role == "router" else []
    r = _start([role, *extra, "--cluster-secret-file", str(path)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert f"tandem {role}: error: --cluster-secret-file {path}: {expected}" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("content, expected", [
    (None, "cannot read it (No such file or directory)"),
    ("", "no keys (expected a 'keys:' list of entries)"),
    ("keys: [", "not valid YAML"),
])
def test_a_bad_api_keys_file_is_a_startup_error(tmp_path, content, expected) -> None:
    path = tmp_path / "keys.yaml"
    if content is not None:
        path.write_text(content)
    r = _start(["router", "--decode", "127.0.0.1:1", "--api-keys-file", str(path)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert f"tandem router: error: --api-keys-file {path}: {expected}" in r.stderr
    assert "Traceback" not in r.stderr
