"""The cluster secret: one random value every router, prefill and decode worker of a
cluster shares, from a file (--cluster-secret-file) or the environment
(TANDEM_CLUSTER_SECRET). Without either, processes of one user on one machine share
a generated file in the cache directory (0600), so a local cluster needs no setup
and a remote one must be given the secret explicitly."""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

ENV = "TANDEM_CLUSTER_SECRET"
MIN_BYTES = 16


class SecretError(ValueError):
    """A secret that cannot be used (the message names the flag or the file)."""


def default_secret_path() -> Path:
    base = os.environ.get("TANDEM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem")
    return Path(base) / "cluster-secret"


def write_secret(path: Path) -> bytes:
    """A new random secret in path, readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "wb") as f:
        f.write(value + b"\n")
    return value


def load_cluster_secret(path: str | None) -> bytes:
    """The secret from path (--cluster-secret-file), else $TANDEM_CLUSTER_SECRET, else the
    per-user default file (created on first use). SecretError naming the source when
    it is missing, unreadable or too short."""
    if path:
        return _read(Path(path), f"--cluster-secret-file {path}")
    env = os.environ.get(ENV)
    if env is not None:
        return _check(env.strip().encode(), f"${ENV}")
    default = default_secret_path()
    if not default.exists():
        try:
            return write_secret(default)
        except FileExistsError:  # another process made it meanwhile
            pass
    return _read(default, f"the default cluster secret file {default}")


def _read(path: Path, what: str) -> bytes:
    try:
        value = path.read_bytes().strip()
    except OSError as e:
        raise SecretError(f"{what}: cannot read it ({e.strerror or e})") from e
    return _check(value, what)


def _check(value: bytes, what: str) -> bytes:
    if len(value) < MIN_BYTES:
        raise SecretError(f"{what}: the cluster secret is {'empty' if not value else 'too short'}"
                          f" ({len(value)} bytes; at least {MIN_BYTES})")
    return value
