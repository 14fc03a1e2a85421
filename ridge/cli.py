"""`ridge` command line: one entry point, one subcommand per job. This module
only composes them; each subcommand lives with what it runs."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def _read_model_shape(path):
    from ridge.models.registry import read_config  # the readers and torch, only for `ridge plan MODEL`
    return read_config(path).shape()


def _engine_option(name: str):
    from ridge.engine.config import engine_options
    return next(o for o in engine_options() if o.name == name)


def build_parser() -> argparse.ArgumentParser:
    from ridge.bench.command import add_bench_parser
    from ridge.bench.daemon import add_bench_daemon_parser
    from ridge.daemon.cli.commands import add_daemon_parsers
    from ridge.daemon.cli.generate import add_generate_parser
    from ridge.daemon.cli.service import add_service_parser
    from ridge.plan import add_plan_parser
    from ridge.tui.command import add_top_parser  # textual is imported only when `ridge top` runs

    parser = argparse.ArgumentParser(prog="ridge", description="A local LLM inference daemon for one GPU.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_plan_parser(sub, _read_model_shape, _engine_option("weights"), _engine_option("block_size"))
    add_daemon_parsers(sub)
    add_bench_parser(sub)
    add_bench_daemon_parser(sub)
    add_top_parser(sub)
    add_service_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else os.environ.get("RIDGE_LOG_LEVEL", "INFO").upper(),
                        stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, MemoryError, OSError) as e:  # user-facing errors: a line, not a traceback
        if args.verbose:
            raise
        print(f"ridge: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
