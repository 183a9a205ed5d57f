"""Cluster tokens: bound to their method and time, accepted once, refused under
another secret; the secret itself comes from a file or the environment, never empty."""
from __future__ import annotations

import os
import stat

import pytest

from auth.secret import SecretError, load_cluster_secret, write_secret
from auth.tokens import MAX_SKEW_S, Verifier, mint, proof

SECRET = b"s" * 32


def test_a_token_opens_one_call_of_its_method_once() -> None:
    v = Verifier(SECRET)
    token = mint(SECRET, "/tandem.decode.Decode/Generate")
    assert v.check(token, "/tandem.prefill.Prefill/Prefill") is not None  # another method
    assert v.check(token, "/tandem.decode.Decode/Generate") is None
    assert "replayed" in v.check(token, "/tandem.decode.Decode/Generate")


@pytest.mark.parametrize("token, why", [
    (None, "no cluster credentials"),
    ("", "no cluster credentials"),
    ("garbage", "malformed"),
    ("v1.x.y.z", "malformed"),
    (mint(b"t" * 32, "/m"), "do not match"),
])
def test_bad_tokens_name_what_is_wrong(token, why) -> None:
    assert why in Verifier(SECRET).check(token, "/m")


def test_old_and_future_tokens_are_refused() -> None:
    v = Verifier(SECRET)
    assert "expired" in v.check(mint(SECRET, "/m", now=1000.0), "/m", now=1000.0 + MAX_SKEW_S + 1)
    assert "expired" in v.check(mint(SECRET, "/m", now=1000.0 + MAX_SKEW_S + 1), "/m", now=1000.0)


def test_proof_depends_on_secret_challenge_and_identity() -> None:
    p = proof(SECRET, b"c1", "prefill@a")
    assert p == proof(SECRET, b"c1", "prefill@a")
    assert len({p, proof(SECRET, b"c2", "prefill@a"), proof(SECRET, b"c1", "prefill@b"),
                proof(b"t" * 32, b"c1", "prefill@a")}) == 4


def test_secret_sources_and_their_errors(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TANDEM_CLUSTER_SECRET", raising=False)
    first = load_cluster_secret(None)  # created on first use, owner-only
    default = tmp_path / "cache" / "cluster-secret"
    assert stat.S_IMODE(os.stat(default).st_mode) == 0o600
    assert load_cluster_secret(None) == first
    monkeypatch.setenv("TANDEM_CLUSTER_SECRET", "from-the-environment-0123")
    assert load_cluster_secret(None) == b"from-the-environment-0123"
    f = tmp_path / "s"
    assert load_cluster_secret(str(write_secret(f) and f)) == f.read_bytes().strip()
    with pytest.raises(SecretError, match="--cluster-secret-file .*missing.*cannot read"):
        load_cluster_secret(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SecretError, match="empty"):
        load_cluster_secret(str(tmp_path / "empty"))
    monkeypatch.setenv("TANDEM_CLUSTER_SECRET", "short")
    with pytest.raises(SecretError, match="TANDEM_CLUSTER_SECRET.*too short"):
        load_cluster_secret(None)
