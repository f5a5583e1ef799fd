"""The ``shinken`` command line.

``shinken demo`` runs the main job (docs/demo.md); ``shinken sandboxes`` starts
local sandboxes and prints how to reach them, for trying the SDK by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shinken", description="Rollout infrastructure for computer-use agents.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run sandboxes + session server + a rollout loop, end to end")
    demo.add_argument("--sandboxes", type=_positive, default=16, help="episodes run at once (default 16)")
    demo.add_argument("--turns", type=_positive, default=10, help="model turns per episode (default 10)")
    demo.add_argument("--workers", type=int, default=2,
                      help="session-server worker processes; 0 = single process (default 2)")
    demo.add_argument("--display", choices=("virtual", "xvfb"), default="virtual")
    demo.add_argument("--port", type=int, default=0, help="session server port on 127.0.0.1 (default: any free)")
    demo.add_argument("--out", default="shinken-demo-out", help="output folder (default ./shinken-demo-out)")

    boxes = sub.add_parser("sandboxes", help="start local sandboxes and print their URLs until Ctrl-C")
    boxes.add_argument("-n", type=_positive, default=1)
    boxes.add_argument("--display", choices=("virtual", "xvfb"), default="virtual")
    return parser


def _sandboxes(args: argparse.Namespace) -> int:
    from shinken_sync.providers.local import LocalProvider

    with LocalProvider(display=args.display) as provider:
        for handle in provider.create_many(args.n):
            url, token = provider.endpoint(handle)
            print(json.dumps({"url": url, "token": token}), flush=True)
        print("Ctrl-C stops them.", file=sys.stderr)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from shinken_sync.demo import DemoError, run
    from shinken_sync.errors import ShinkenError

    try:
        if args.command == "demo":
            if args.workers < 0:
                raise DemoError("--workers must be 0 or more")
            return run(args)
        return _sandboxes(args)
    except (DemoError, ShinkenError) as exc:
        print(f"shinken {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
