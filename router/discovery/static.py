"""A fixed worker list: from flags, the TANDEM_PREFILL / TANDEM_DECODE
environment variables (comma-separated host:port), or a YAML file
(``prefill: [host:port, ...]`` and ``decode: [...]``)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import AsyncIterator

import yaml

from router.discovery.base import Discovery, WorkerEndpoint


def _check(addr: str, source: str) -> str:
    host, _, port = addr.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{source}: worker address {addr!r} is not host:port")
    return addr.strip()


def static_endpoints(prefill: tuple[str, ...] = (), decode: tuple[str, ...] = (),
                     workers_file: str | None = None) -> frozenset[WorkerEndpoint]:
    """Flags win; then the YAML file; then the environment."""
    out: set[WorkerEndpoint] = set()
    lists = {"prefill": list(prefill), "decode": list(decode)}
    if workers_file and not (prefill or decode):
        try:
            data = yaml.safe_load(Path(workers_file).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--workers-file {workers_file}: {e}") from e
        unknown = set(data) - {"prefill", "decode"}
        if unknown:
            raise ValueError(f"--workers-file {workers_file}: unknown key {sorted(unknown)[0]!r} "
                             "(expected prefill, decode)")
        lists = {k: list(data.get(k) or []) for k in lists}
    for role in lists:
        if not lists[role] and not (prefill or decode or workers_file):
            env = os.environ.get(f"TANDEM_{role.upper()}", "")
            lists[role] = [a for a in env.split(",") if a.strip()]
        source = f"--{role}"
        out |= {WorkerEndpoint(role, _check(a, source)) for a in lists[role]}  # type: ignore[arg-type]
    return frozenset(out)


class StaticDiscovery(Discovery):
    def __init__(self, endpoints: frozenset[WorkerEndpoint]) -> None:
        self.endpoints = endpoints

    async def watch(self) -> AsyncIterator[frozenset[WorkerEndpoint]]:
        yield self.endpoints
        await asyncio.Event().wait()  # a static list never changes
