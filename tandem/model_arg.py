"""The --model / --cache-dir arguments every command shares, and resolving them."""
from __future__ import annotations

import argparse
from pathlib import Path

from tandem.fetch_model import default_model_path, fetch_model


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="",
                   help="a .gguf file or an HF directory (config.json + *.safetensors); "
                        "default: the embedded SmolLM2-135M-Instruct, fetched on first use")
    p.add_argument("--cache-dir", default=None,
                   help="model cache (default: $TANDEM_CACHE or $XDG_CACHE_HOME/tandem)")


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        if not Path(args.model).expanduser().exists():
            raise FileNotFoundError(f"--model {args.model}: no such file or directory")
        return str(Path(args.model).expanduser())
    path = default_model_path(args.cache_dir)
    if not path.is_file():
        fetch_model(args.cache_dir)
    return str(path)
