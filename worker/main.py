"""Run one worker process (`tandem prefill` / `tandem decode`) until SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from engine.config import EngineConfig
from tandem.config_cli import add_config_args, config_from_args
from worker.config import KVTransferConfig, WorkerConfig

log = logging.getLogger(__name__)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    from tandem.commands import add_model_arg

    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks one (default: 0)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="HTTP port for Prometheus /metrics (default: none)")
    p.add_argument("--worker-id", default="", help="name in traces (default: role@host:port)")
    p.add_argument("--advertise-host", default="",
                   help="address peers dial (default: --host, or this machine's address when "
                        "--host is 0.0.0.0)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, seconds to finish running requests (default: 30)")
    p.add_argument("--kv-blocks", dest="num_kv_blocks", type=int, default=None,
                   help="cap the KV pool at N blocks (default: size from --kv-cache-memory-gib)")
    p.add_argument("--ready-file", default=None,
                   help="write 'host:port metrics_port' here once serving (for launchers)")
    add_config_args(p, EngineConfig, skip=("model", "num_kv_blocks"))
    add_config_args(p, KVTransferConfig, flag_names={"backend": "kv-transfer"})


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    from tandem.commands import resolve_model

    engine = config_from_args(EngineConfig, args, model=resolve_model(args))
    kv = config_from_args(KVTransferConfig, args)
    return WorkerConfig(engine=engine, kv=kv, host=args.host, port=args.port,
                        metrics_port=args.metrics_port, worker_id=args.worker_id,
                        advertise_host=args.advertise_host,
                        drain_timeout_s=args.drain_timeout_s)


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
        import os
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


def run_worker(role: str, args: argparse.Namespace) -> int:
    import uvloop

    config = worker_config(args)
    if role == "prefill":
        from prefill_svc.service import PrefillService as cls
    else:
        from decode_svc.service import DecodeService as cls
    return uvloop.run(serve(cls(config), args.ready_file))
