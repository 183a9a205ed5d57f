"""`tandem prefill` / `tandem decode`: flags (generated from the worker configs),
the config they make, and the process that serves one worker until SIGINT/SIGTERM."""
from __future__ import annotations

import argparse

from engine.config import EngineConfig
from tandem.config_cli import add_config_args, config_from_args
from tandem.model_arg import add_model_arg, resolve_model
from worker.config import KVTransferConfig, WorkerConfig


def add_worker_args(p: argparse.ArgumentParser) -> None:
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
    engine = config_from_args(EngineConfig, args, model=resolve_model(args))
    kv = config_from_args(KVTransferConfig, args)
    return WorkerConfig(engine=engine, kv=kv, host=args.host, port=args.port,
                        metrics_port=args.metrics_port, worker_id=args.worker_id,
                        advertise_host=args.advertise_host,
                        drain_timeout_s=args.drain_timeout_s)


def run_prefill(args: argparse.Namespace) -> int:
    import uvloop

    from prefill_svc.service import PrefillService
    from worker.serve import serve

    return uvloop.run(serve(PrefillService(worker_config(args)), args.ready_file))


def run_decode(args: argparse.Namespace) -> int:
    import uvloop

    from decode_svc.service import DecodeService
    from worker.serve import serve

    return uvloop.run(serve(DecodeService(worker_config(args)), args.ready_file))
