"""`tandem up`: a whole local cluster — N prefill workers, M decode workers and
the router on 127.0.0.1:8000 — each worker pinned to its own core where the
machine has enough; the router then runs on the prefill workers' cores, so decode
workers have theirs to themselves. Ctrl-C (or SIGTERM) stops every process it
started.

Every service is a child process under supervision (tandem/supervisor.py): one
that dies (a kill -9, an engine that died and exited 1) is restarted on the same
port, and the router finds it again through its health checks. A service that
keeps crashing stops the whole cluster with exit status 1."""
from __future__ import annotations

import argparse
import signal


def add_up_args(p: argparse.ArgumentParser) -> None:
    from tandem.model_arg import add_model_arg

    add_model_arg(p)
    p.add_argument("--mode", choices=("disagg", "colocated"), default="disagg",
                   help="disagg: prefill and decode pools; colocated: one engine does both "
                        "(the baseline) (default: disagg)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default: 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default: 1)")
    p.add_argument("--kv-transfer", choices=("nixl", "tcp"), default="nixl",
                   help="KV transfer backend between workers (default: nixl)")
    p.add_argument("--host", default="127.0.0.1", help="router bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="router HTTP port (default: 8000)")
    p.add_argument("--kv-blocks", type=int, default=None, help="cap each worker's KV pool")
    p.add_argument("--swap-space", type=float, default=None,
                   help="host swap pool per worker, GiB (default: the workers' 1.0)")
    p.add_argument("--preemption-mode", choices=("auto", "swap", "recompute"), default=None,
                   help="how a full decode worker preempts (default: the workers' auto)")
    p.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16 (default: auto)")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="every worker's KV cache: auto, bfloat16, float32, int8, fp8_e4m3 "
                        "(default: the workers' auto)")
    p.add_argument("--max-model-len", type=int, default=None, help="context window")
    p.add_argument("--kv-policy", default=None, metavar="POLICY",
                   help="every worker's and the router's --kv-policy: full, "
                        "streaming:sinks=S,window=W or "
                        "h2o:heavy=H,recent=R[,sinks=S][,halflife=T][,score=mean] "
                        "(default: full)")
    p.add_argument("--max-stream-len", type=int, default=None,
                   help="every worker's and the router's --max-stream-len: most tokens of a "
                        "request under a bounded kv policy (default: theirs, 1048576)")
    p.add_argument("--local-prefill-threshold", type=int, default=32,
                   help="prompts with at most this many uncached tokens prefill on the decode "
                        "worker (default: 32)")
    p.add_argument("--routing", choices=("prefix", "round_robin"), default="prefix",
                   help="placement policy (default: prefix)")
    p.add_argument("--log-requests", default=None, metavar="PATH",
                   help="the router writes each request's trace (workers, predicted and "
                        "realized prefix hit, bytes moved, fallbacks) as a JSON line to PATH")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="every service exports OpenTelemetry traces to this OTLP/HTTP "
                        "collector, e.g. http://localhost:4318 (default: the OTEL_EXPORTER_OTLP_* "
                        "variables, which the services inherit, else no tracing)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every worker (repeat), e.g. --worker-arg=--no-enable-prefix-caching")
    p.add_argument("--prefill-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for prefill workers only (repeat), after --worker-arg, "
                        "e.g. --prefill-arg=--kv-blocks=200")
    p.add_argument("--decode-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for decode workers only (repeat; in colocated mode, "
                        "for the one engine), after --worker-arg")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the router (repeat), e.g. --router-arg=--max-queue=64")
    p.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help="the secret its processes share (default: a new random one per run)")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                   help="restart a service that exits (default: on)")


def run_up(args: argparse.Namespace) -> int:
    from tandem.model_arg import resolve_model
    from tandem.supervisor import Cluster

    if args.mode == "disagg" and (args.prefill < 0 or args.decode < 1):
        raise ValueError("--decode must be >= 1 and --prefill >= 0")
    model = resolve_model(args)
    cluster = Cluster(args, model)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    # Ctrl-C stops the cluster even where the shell started us with SIGINT ignored (a
    # background job of a script): Python leaves an inherited SIG_IGN in place
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return cluster.run()
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


