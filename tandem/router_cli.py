"""`tandem router`: flags (generated from RouterConfig), the config they make, and
the HTTP edge served with uvicorn on uvloop."""
from __future__ import annotations

import argparse
import logging
import socket

from router.config import RouterConfig
from tandem.config_cli import add_config_args, config_from_args
from tandem.model_arg import add_model_arg, resolve_model


def add_router_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                   help="a prefill worker (repeat for several)")
    p.add_argument("--decode", action="append", default=[], metavar="HOST:PORT",
                   help="a decode worker (repeat for several)")
    add_config_args(p, RouterConfig, skip=("model", "prefill", "decode"))


def router_config(args: argparse.Namespace) -> RouterConfig:
    if args.api_key:
        logging.getLogger("tandem").warning(
            "--api-key is visible to every user of this machine (ps); prefer "
            "--api-keys-file or $TANDEM_API_KEY")
    return config_from_args(RouterConfig, args, model=resolve_model(args),
                            prefill=tuple(args.prefill), decode=tuple(args.decode))


def run_router(config: RouterConfig, log_level: str = "warning") -> None:
    import uvicorn

    from router.app import create_app

    app = create_app(config)
    server = uvicorn.Config(app, host=config.host, port=config.port, loop="uvloop",
                            log_level=log_level.lower(), timeout_graceful_shutdown=5)
    sockets = [server.bind_socket()]
    if config.metrics_port is not None:  # one server, two ports (router/http/metrics_port.py)
        from router.http.metrics_port import split_metrics_port

        sockets.append(_listen(config.host, config.metrics_port, "--metrics-port"))
        metrics_port = sockets[1].getsockname()[1]
        server.app = split_metrics_port(app, metrics_port)
        logging.getLogger("tandem").info("router metrics on http://%s:%d/metrics",
                                         config.host, metrics_port)
    uvicorn.Server(server).run(sockets=sockets)


def _listen(host: str, port: int, flag: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise RuntimeError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror})") from e
