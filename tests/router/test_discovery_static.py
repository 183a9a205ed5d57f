"""Static discovery: flags, else a YAML file, else the environment; bad entries name
their source."""
from __future__ import annotations

import pytest

from router.config import RouterConfig
from router.discovery.base import WorkerEndpoint
from router.discovery.static import static_endpoints


def test_flags_file_env_precedence(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_PREFILL", "10.0.0.1:9000")
    monkeypatch.setenv("TANDEM_DECODE", "10.0.0.2:9000,10.0.0.3:9000")
    assert static_endpoints() == {WorkerEndpoint("prefill", "10.0.0.1:9000"),
                                  WorkerEndpoint("decode", "10.0.0.2:9000"),
                                  WorkerEndpoint("decode", "10.0.0.3:9000")}
    f = tmp_path / "workers.yaml"
    f.write_text("prefill: [a:1]\ndecode: [b:2]\n")
    assert static_endpoints(workers_file=str(f)) == {WorkerEndpoint("prefill", "a:1"),
                                                     WorkerEndpoint("decode", "b:2")}
    assert static_endpoints(decode=("c:3",)) == {WorkerEndpoint("decode", "c:3")}


def test_bad_entries_name_their_source(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TANDEM_PREFILL", raising=False)
    monkeypatch.delenv("TANDEM_DECODE", raising=False)
    with pytest.raises(ValueError, match="--decode.*'nohost'"):
        static_endpoints(decode=("nohost",))
    f = tmp_path / "w.yaml"
    f.write_text("decoder: [b:2]\n")
    with pytest.raises(ValueError, match="unknown key 'decoder'"):
        static_endpoints(workers_file=str(f))
    with pytest.raises(ValueError, match="--decode: at least one decode worker"):
        RouterConfig().make_discovery()
    with pytest.raises(ValueError, match="--routing"):
        RouterConfig(routing="random")
