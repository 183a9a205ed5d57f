"""Server identity: a client's dialed target and a server's names are spelled alike,
so a token made for the address a client dialed opens that server and no other."""
from __future__ import annotations

import pytest

from auth.targets import normalize, server_names


@pytest.mark.parametrize("target, name", [
    ("127.0.0.1:9000", "127.0.0.1:9000"),
    ("dns:///Prefill-0.Tandem.svc.:9000", "prefill-0.tandem.svc:9000"),
    ("dns://10.96.0.10/prefill-0:9000", "prefill-0:9000"),  # the authority is the resolver
    ("ipv4:10.0.0.5:9000", "10.0.0.5:9000"),
    ("[fd00:0::5]:9000", "[fd00::5]:9000"),
    ("ipv6:[::1]:9000", "[::1]:9000"),
    ("prefill-0", "prefill-0:443"),  # gRPC's default port
    ("unix:/run/tandem.sock", "unix:/run/tandem.sock"),
])
def test_targets_are_spelled_one_way(target, name) -> None:
    assert normalize(target) == name


def test_a_server_answers_to_its_advertised_bind_and_loopback_names() -> None:
    loop = {"127.0.0.1:9000", "localhost:9000", "[::1]:9000"}
    # tandem up, the README's services, tests: bound to loopback
    assert server_names("127.0.0.1", 9000, "127.0.0.1") == loop
    # a pod, or a hand-started worker on every interface: its advertised address too
    assert server_names("0.0.0.0", 9000, "10.1.2.3") == loop | {"10.1.2.3:9000"}
    assert server_names("::", 9000, "fd00::5") == loop | {"[fd00::5]:9000"}
    # the chart: bound to the pod IP, which it advertises, and nothing else
    assert server_names("10.1.2.3", 9000, "10.1.2.3") == {"10.1.2.3:9000"}
    assert server_names("10.1.2.3", 9000, "Prefill-0.Tandem.svc") == \
        {"10.1.2.3:9000", "prefill-0.tandem.svc:9000"}
