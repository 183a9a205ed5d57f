"""Cluster tokens: bound to their method, server, message and time, accepted once,
refused under another secret; the secret itself comes from a file or the environment,
never empty."""
from __future__ import annotations

import os
import stat
from importlib import import_module
from pathlib import Path

import pytest

from auth.secret import SecretError, load_cluster_secret, write_secret
from auth.tokens import MAX_SKEW_S, Verifier, mint, proof

SECRET = b"s" * 32


T = "10.0.0.5:9000"
GEN = "/tandem.decode.Decode/Generate"


def _verifier() -> Verifier:
    return Verifier(SECRET, frozenset({T, "127.0.0.1:9000"}))


def test_a_token_opens_one_call_of_its_method_server_and_message_once() -> None:
    v = _verifier()
    token = mint(SECRET, GEN, T, b"body")
    assert "do not match" in v.check(token, "/tandem.prefill.Prefill/Prefill", b"body")
    assert v.check(token, GEN, b"body") is None
    assert "replayed" in v.check(token, GEN, b"body")


def test_another_message_is_refused_and_spends_nothing() -> None:
    """A body swapped in flight is refused naming the message, and does not burn the
    nonce: the real call, arriving after it, still passes."""
    v = _verifier()
    token = mint(SECRET, GEN, T, b"body")
    assert v.check(token, GEN, b"other") == \
        "cluster credentials were made for another request message (sha256 differs)"
    assert v.check(token, GEN, b"body") is None


def test_another_server_is_refused_naming_both_and_the_flag() -> None:
    why = _verifier().check(mint(SECRET, GEN, "10.0.0.6:9000", b""), GEN, b"")
    assert why.startswith("cluster credentials were made for server 10.0.0.6:9000, but this "
                          "server answers to 10.0.0.5:9000, 127.0.0.1:9000")
    assert "--advertise-host" in why
    assert "answers to no name" in Verifier(SECRET).check(mint(SECRET, GEN, T, b""), GEN, b"")


def test_the_target_is_no_free_text() -> None:
    """The target travels in clear after the MAC; changing it breaks the MAC."""
    token = mint(SECRET, GEN, "10.0.0.6:9000", b"")
    forged = token[:-len("10.0.0.6:9000")] + T
    assert "do not match" in _verifier().check(forged, GEN, b"")


@pytest.mark.parametrize("token, why", [
    (None, "no cluster credentials"),
    ("", "no cluster credentials"),
    ("garbage", "malformed"),
    ("v1.1.y.z", "malformed"),
    ("v2.x.n.d.m.10.0.0.5:9000", "malformed"),
    (mint(b"t" * 32, "/m", T, b""), "do not match"),
])
def test_bad_tokens_name_what_is_wrong(token, why) -> None:
    assert why in _verifier().check(token, "/m", b"")


def test_old_and_future_tokens_are_refused() -> None:
    v = _verifier()
    assert "expired" in v.check(mint(SECRET, "/m", T, b"", now=1000.0), "/m", b"",
                                now=1000.0 + MAX_SKEW_S + 1)
    assert "expired" in v.check(mint(SECRET, "/m", T, b"", now=1000.0 + MAX_SKEW_S + 1), "/m",
                                b"", now=1000.0)


def test_every_rpc_takes_one_request_message_of_one_spelling() -> None:
    """A token covers one message's digest, so no Tandem RPC may stream its requests
    (the server refuses such a method outright); and the client digests its own
    SerializeToString(), which equals the stub's bytes as long as no message has a map
    field (the one kind whose order protobuf leaves open)."""
    import proto

    files = [import_module(f"proto.{f.stem}_pb2").DESCRIPTOR
             for f in sorted(Path(proto.__file__).parent.glob("*.proto"))]
    methods = [m for f in files for s in f.services_by_name.values() for m in s.methods]
    assert len(methods) >= 11
    assert [m.full_name for m in methods if m.client_streaming] == []

    def maps(m) -> list[str]:
        return [f.full_name for f in m.fields if f.message_type is not None
                and f.message_type.GetOptions().map_entry] + \
            [x for n in m.nested_types for x in maps(n)]
    assert [x for f in files for m in f.message_types_by_name.values() for x in maps(m)] == []


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
