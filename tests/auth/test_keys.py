"""API keys at the edge: a file of keys with priority ceilings and rate limits,
re-read when it changes; every bad entry is an error naming the field."""
from __future__ import annotations

import os
import time

import pytest

from auth.keys import KeyFileError, KeyRing, load_metrics_key


def _write(path, text: str) -> None:
    path.write_text(text)
    os.utime(path, (time.time() + 1, time.time() + 1))  # a new mtime even within a second


def test_keys_from_file_env_and_flag(tmp_path, monkeypatch) -> None:
    f = tmp_path / "keys.yaml"
    _write(f, "keys:\n  - {key: sk-file-key-1, name: team-a, priority_ceiling: 5}\n")
    monkeypatch.setenv("TANDEM_API_KEY", "sk-env-one-1, sk-env-two-2")
    ring = KeyRing.from_config(str(f), "sk-flag-key-3")
    assert ring.enabled
    assert ring.lookup(b"sk-file-key-1").priority_ceiling == 5
    assert ring.lookup(b"sk-env-two-2") is not None and ring.lookup(b"sk-flag-key-3") is not None
    assert ring.lookup(b"sk-nope") is None and ring.lookup("sk-é".encode()) is None


def test_a_changed_file_is_reread_and_a_broken_one_keeps_the_old_keys(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.setattr("auth.keys.RELOAD_CHECK_S", 0.0)
    f = tmp_path / "keys.yaml"
    _write(f, "keys:\n  - key: sk-old-key-1\n")
    ring = KeyRing.from_config(str(f), None)
    _write(f, "keys:\n  - key: sk-new-key-2\n")
    assert ring.lookup(b"sk-new-key-2") is not None and ring.lookup(b"sk-old-key-1") is None
    _write(f, "keys: [this is not: valid")
    assert ring.lookup(b"sk-new-key-2") is not None  # kept


def test_rate_limit_is_a_token_bucket(tmp_path) -> None:
    f = tmp_path / "keys.yaml"
    _write(f, "keys:\n  - {key: sk-limited-1, rate_limit_rps: 2, burst: 2}\n")
    key = KeyRing(str(f)).lookup(b"sk-limited-1")
    assert key.take(now=100.0) == 0.0 and key.take(now=100.0) == 0.0
    assert key.take(now=100.0) == pytest.approx(0.5)
    assert key.take(now=100.5) == 0.0


@pytest.mark.parametrize("text, message", [
    ("", "no keys"),
    ("keys: []", "no keys"),
    ("keys:\n  - {name: x}", r"keys\[0\]\.key"),
    ("keys:\n  - {key: short}", r"keys\[0\]\.key"),
    ("keys:\n  - {key: sk-long-enough, priority_ceiling: high}", r"keys\[0\]\.priority_ceiling"),
    ("keys:\n  - {key: sk-long-enough, rate_limit_rps: 0}", r"keys\[0\]\.rate_limit_rps"),
    ("keys:\n  - {key: sk-long-enough, colour: red}", "unknown field 'colour'"),
    ("keys:\n  - {key: sk-long-enough, cache_group: ''}", r"keys\[0\]\.cache_group"),
    ("keys:\n  - {key: sk-long-enough, cache_group: [a]}", r"keys\[0\]\.cache_group"),
])
def test_bad_key_files_name_the_field(tmp_path, text, message) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(text)
    with pytest.raises(KeyFileError, match=f"--api-keys-file .*{message}"):
        KeyRing(str(f))


def test_missing_key_file_and_metrics_key(tmp_path, monkeypatch) -> None:
    with pytest.raises(KeyFileError, match="--api-keys-file .*cannot read"):
        KeyRing(str(tmp_path / "absent.yaml"))
    monkeypatch.delenv("TANDEM_METRICS_KEY", raising=False)
    assert load_metrics_key(None) is None
    (tmp_path / "m").write_text("")
    with pytest.raises(KeyFileError, match="--metrics-key-file .*empty"):
        load_metrics_key(str(tmp_path / "m"))
    monkeypatch.setenv("TANDEM_METRICS_KEY", "scrape-me")
    assert load_metrics_key(None) == b"scrape-me"


def test_a_key_in_a_log_line_shows_its_name_not_its_secret() -> None:
    from auth.keys import ApiKey

    key = ApiKey(b"sk-team-a-0123456789", "team-a")
    assert "sk-team-a" not in repr(key) and "team-a" in repr(key)
