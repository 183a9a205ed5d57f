"""The fingerprint cache ($TANDEM_CACHE/fingerprints.json) holds the files on disk now."""
from __future__ import annotations

import json

from engine.loader.fingerprint import file_digest


def test_the_cache_forgets_files_that_are_gone(tmp_path, monkeypatch) -> None:
    """A digest is read back while its file is unchanged; entries of deleted files are
    dropped at the next write (before: they stayed, thousands of them, each start reading
    and rewriting them all)."""
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"first")
    b.write_bytes(b"second")
    first = file_digest(a)
    assert file_digest(a) == first
    a.unlink()
    file_digest(b)
    keys = json.loads((tmp_path / "cache" / "fingerprints.json").read_text())
    assert [k.rsplit(":", 2)[0] for k in keys] == [str(b.resolve())]
