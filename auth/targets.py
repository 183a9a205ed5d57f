"""Server identity for cluster tokens: the address a client dialed, in one spelling.

A client binds each token to the channel target it dialed (``normalize``); a server
accepts the names it answers to (``server_names``). Both sides spell an address the
same way: ``10.0.0.5:9000``, ``dns:///10.0.0.5:9000`` and ``ipv4:10.0.0.5:9000`` are
one name, a DNS name is lower case without a trailing dot, and an IPv6 literal is
``[compressed]:port``. Names are compared as written, never resolved: resolving would
make a token's validity depend on DNS at the moment it is checked."""
from __future__ import annotations

import ipaddress

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_STRIPPED_SCHEMES = ("dns:", "ipv4:", "ipv6:")
_GRPC_DEFAULT_PORT = "443"  # what gRPC dials when a target names no port


def join(host: str, port: int | str) -> str:
    """host:port, bracketing an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host(host: str) -> str:
    host = host.strip("[]").rstrip(".").lower()
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host


def normalize(target: str) -> str:
    """A gRPC channel target as ``host:port``; other schemes (unix:...) as given."""
    t = target.strip()
    for scheme in _STRIPPED_SCHEMES:
        if t.startswith(scheme):
            t = t[len(scheme):]
            if t.startswith("//"):  # dns://resolver/host:port names its resolver first
                t = t[2:].partition("/")[2]
            break
    else:
        if t.partition(":")[0] in ("unix", "unix-abstract", "vsock"):
            return t
    if t.startswith("["):
        host, _, rest = t[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else _GRPC_DEFAULT_PORT
    elif t.count(":") == 1:
        host, port = t.split(":")
    else:  # no port, or an unbracketed IPv6 literal, which gRPC reads as a host alone
        host, port = t, _GRPC_DEFAULT_PORT
    return join(_host(host), port)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(_host(host))
    except ValueError:
        return None


def _wildcard(host: str) -> bool:
    ip = _ip(host)
    return _host(host) == "" or (ip is not None and ip.is_unspecified)


def _local(host: str) -> bool:
    """A wildcard or loopback bind: its own machine reaches it as 127.0.0.1."""
    ip = _ip(host)
    return _wildcard(host) or _host(host) == "localhost" or (ip is not None and ip.is_loopback)


def server_names(bind_host: str, port: int, public_host: str) -> frozenset[str]:
    """The targets a server bound to bind_host:port accepts tokens for: its advertised
    address (public_host: what it writes into KV handles, what discovery lists), its
    bind address, and for a wildcard or loopback bind the loopback forms (127.0.0.1,
    localhost, [::1]), by which its own machine reaches it. A wildcard is no name."""
    hosts = {public_host, bind_host} | (set(LOOPBACK_HOSTS) if _local(bind_host) else set())
    return frozenset(normalize(join(_host(h), port)) for h in hosts if not _wildcard(h))
