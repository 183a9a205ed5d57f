"""A worker process's life: start the service, announce it, run until SIGINT/SIGTERM
(then drain) or until its engine dies (then exit 1, so a supervisor restarts it)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)


async def serve(service, ready_file: str | None) -> int:
    """Run until SIGINT/SIGTERM (then drain) or until the engine dies; the exit code
    (1 when the engine died, so a supervisor or Kubernetes restarts the worker)."""
    import uvloop  # noqa: F401 - imported to fail early if missing

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    msg = f"{service.config.host}:{service.port} {service.metrics_port or 0}"
    print(f"{service.worker_id} ready on {msg}", file=sys.stderr, flush=True)
    if ready_file:
        with open(ready_file + ".tmp", "w") as f:
            f.write(msg)
        os.replace(ready_file + ".tmp", ready_file)
    died = asyncio.ensure_future(service.died.wait())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({died, stopped}, return_when=asyncio.FIRST_COMPLETED)
    died.cancel()
    stopped.cancel()
    if service.died.is_set():
        log.critical("%s: engine died; exiting with status 1", service.worker_id)
        await service.stop(0)
        return 1
    log.info("%s draining (up to %.0fs)", service.worker_id, service.config.drain_timeout_s)
    await service.drain(service.config.drain_timeout_s)
    await service.stop()
    return 0
