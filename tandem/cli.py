"""The `tandem` command: one console script for every service and tool."""
from __future__ import annotations

import argparse
import logging
import sys

from core.progress import show_progress
from tandem import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: disaggregated prefill/decode LLM serving.")
    parser.add_argument("--log-level", default="WARNING",
                        help="Python logging level for messages on stderr (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (setup, run, help_) in commands.COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        setup(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    show_progress(logging.getLogger().level)
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"tandem {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
