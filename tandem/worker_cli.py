"""`tandem prefill` / `tandem decode`: flags (generated from the worker configs),
the config they make, and the process that serves one worker until SIGINT/SIGTERM."""
from __future__ import annotations

import argparse

from auth.secret import load_cluster_secret
from engine.config import EngineConfig
from tandem.config_cli import add_config_args, config_from_args
from tandem.model_arg import add_model_arg, resolve_model
from worker.config import KVTransferConfig, WorkerConfig


PREFILL_DEFAULTS = {"max_num_batched_tokens": 2048, "compile_max_batch": 1,
                    "compile_graph_max_batch": 0}
"""A prefill worker's own engine defaults. Its steps carry no decode rows, so a larger
chunk costs no other request's inter-token latency, and prefill runs faster in larger
GEMMs: 4 prompts of 512 tokens in process, 1,745 tok/s in chunks of 512, 2,384-2,847 in
one chunk of 2,048 (docs/performance.md, section f). It never runs a decode step, so it
compiles the smallest decode bucket only, per layer (the one-graph buckets cost 20 s of
a restart and 80 s of a first start on a 2-core EPYC), and its compiled prefill steps."""


def add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    """role: prefill | decode (a decode worker also prefills when it runs colocated)."""
    add_model_arg(p)
    add_config_args(p, WorkerConfig, skip=("engine", "kv", "kv_peers"))
    p.add_argument("--kv-peer", action="append", default=[], metavar="HOST:PORT",
                   help="decode workers: a prefill worker to accept KV from, besides those "
                        "the routers' discovery lists (repeat)")
    p.add_argument("--kv-blocks", dest="num_kv_blocks", type=int, default=None,
                   help="cap the KV pool at N blocks (default: size from --kv-cache-memory-gib)")
    p.add_argument("--ready-file", default=None,
                   help="write 'host:port metrics_port' here once serving (for launchers)")
    add_config_args(p, EngineConfig, skip=("model", "num_kv_blocks"),
                    defaults=PREFILL_DEFAULTS if role == "prefill" else None)
    add_config_args(p, KVTransferConfig, flag_names={"backend": "kv-transfer"})


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    engine = config_from_args(EngineConfig, args, model=resolve_model(args))
    kv = config_from_args(KVTransferConfig, args)
    return config_from_args(WorkerConfig, args, engine=engine, kv=kv,
                            kv_peers=tuple(args.kv_peer))


def check_named_files(args: argparse.Namespace) -> None:
    """Read the secret file the user named before torch and the model load (seconds), so
    a wrong path or a short secret is a start-up error at once (the service reads it
    again when it starts)."""
    if args.cluster_secret_file:
        load_cluster_secret(args.cluster_secret_file)


def run_prefill(args: argparse.Namespace) -> int:
    check_named_files(args)
    import uvloop

    from prefill_svc.service import PrefillService
    from worker.serve import serve

    return uvloop.run(serve(PrefillService(worker_config(args)), args.ready_file))


def run_decode(args: argparse.Namespace) -> int:
    check_named_files(args)
    import uvloop

    from decode_svc.service import DecodeService
    from worker.serve import serve

    return uvloop.run(serve(DecodeService(worker_config(args)), args.ready_file))
