"""`ridge top` on the command line. Textual is imported only when the command runs,
so that `ridge` itself starts without it."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_top_parser(sub) -> None:
    p = sub.add_parser("top", help="a live dashboard of the daemon: memory headroom, KV cache, tokens/s, requests",
                       description="Follows a running `ridge serve` through its stats feed (docs/protocol.md). "
                                   "Keys: ? help, p pause, w time window, Enter request details, q quit.")
    p.add_argument("--endpoint", default=None,
                   help="daemon endpoint (default: $RIDGE_ENDPOINT, then the user socket, then the system socket)")
    p.add_argument("--record", type=Path, default=None, metavar="FILE",
                   help="append every stats frame received to FILE (msgpack), for --replay")
    p.add_argument("--replay", type=Path, default=None, metavar="FILE",
                   help="show a recording instead of a live daemon")
    p.set_defaults(func=run_top)


def run_top(args: argparse.Namespace) -> int:
    from .app import TopApp
    from .feed import replay

    frames = list(replay(args.replay)) if args.replay else None
    app = TopApp(args.endpoint, replay=frames, replay_name=str(args.replay), record=args.record)
    app.run()
    return app.return_code or 0
