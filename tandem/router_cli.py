"""`tandem router`: flags (generated from RouterConfig), the config they make, and
the HTTP edge served with uvicorn on uvloop."""
from __future__ import annotations

import argparse
import logging

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
    from router.app import create_app
    from router.http.server import serve

    serve(create_app(config), config, log_level)
