"""The ``shinken`` command line.

``shinken demo`` runs the main job (docs/demo.md); ``shinken sandboxes`` starts
local sandboxes and prints how to reach them, for trying the SDK by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from shinken_sync.cliargs import EXIT_USAGE, Parser, non_negative_int, port, positive_int

DISPLAYS = ("virtual", "xvfb")
DEMO_WORKERS = 2
# Options of Ray mode only: without --ray they would change nothing, so they are refused.
RAY_ONLY = ("--drivers", "--session-server", "--node-ip")
ENGINE_FLAGS = ("--backend-url", "--tokenizer", "--backend-kind")
DISPLAY_HELP = ("virtual: a cheap drawn desktop in each daemon; xvfb: a real X server per sandbox with a "
                "terminal on it (needs Xvfb, xdotool, xterm and the [xvfb] extra)")


PROVIDER_HELP = ("where sandboxes run: 'local' (shinkend processes on this host) or 'isolated' (each in its "
                 "own namespaces and cgroup; root, bubblewrap; docs/sandboxes.md), or a provider config as "
                 "JSON, inline or @FILE")


def build_parser() -> Parser:
    parser = Parser(prog="shinken", description="Rollout infrastructure for computer-use agents.", version=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run sandboxes + session server + a rollout loop, end to end",
                          description="Run N sandboxes, the session server and a blocking rollout loop; "
                                      "write trajectories, a contact sheet and a summary (docs/demo.md).")
    demo.add_argument("--sandboxes", type=positive_int, default=16, help="episodes run at once")
    demo.add_argument("--turns", type=positive_int, default=10, help="model turns per episode")
    # --workers and --port default to None ("not given") so that Ray mode with --session-server,
    # where the demo starts no session server, can refuse them; _check_demo_options fills them in.
    demo.add_argument("--workers", type=non_negative_int, default=None,
                      help=f"worker processes of the session server the demo starts; 0 = single process "
                           f"(default: {DEMO_WORKERS})")
    demo.add_argument("--display", choices=DISPLAYS, default="virtual", help=DISPLAY_HELP)
    demo.add_argument("--provider", default="local", metavar="TYPE|JSON|@FILE", help=PROVIDER_HELP)
    demo.add_argument("--port", type=port, default=None,
                      help="port of the session server the demo starts (on 127.0.0.1, in Ray mode on this "
                           "node's cluster address); 0 = any free port (default: 0)")
    demo.add_argument("--out", default="shinken-demo-out",
                      help="output folder: created if missing; a previous demo's outputs in it are replaced, "
                           "a folder holding anything else is refused")
    engine = demo.add_argument_group("a real inference engine instead of the embedded reference backend "
                                     "(docs/own-model.md)")
    engine.add_argument("--backend-url", metavar="URL", default=None,
                        help="the engine the demo's session server sits in front of (vLLM or SGLang); a text-only "
                             "engine (vLLM) gets each observation as text (default: the reference backend)")
    engine.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="the engine's tokenizer folder (tokenizer.json + chat template; needs the [hf] extra; "
                             "default: the reference backend's byte tokenizer)")
    engine.add_argument("--backend-kind", metavar="sglang|vllm|auto", default=None,
                        help="the engine's dialect (default: auto, the engine is asked at start-up)")
    demo.add_argument("--view", action="store_true",
                      help="print the session server's viewer URL, show the sandboxes live on it, and keep "
                           "everything up after the episodes until Ctrl-C (docs/viewer.md; default: off)")
    ray = demo.add_argument_group("Ray mode (docs/scale-out.md; needs the [ray] extra)")
    ray.add_argument("--ray", metavar="auto|ADDRESS", default=None,
                     help="run the rollout on a Ray cluster: sandboxes placed by RayProvider, episodes run by "
                          "driver actors ('auto': RAY_ADDRESS or the cluster started on this machine; "
                          "default: off, everything in this process)")
    ray.add_argument("--drivers", type=positive_int, default=None,
                     help="driver actors in Ray mode (default: one per alive node)")
    ray.add_argument("--session-server", metavar="URL", default=None,
                     help="in Ray mode, the session server(s) front (e.g. nginx); default: start one on "
                          "this node's cluster address")
    ray.add_argument("--node-ip", metavar="IP", default=None,
                     help="in Ray mode, this machine's address in the cluster (default: Ray's own choice)")

    boxes = sub.add_parser("sandboxes", help="start local sandboxes and print their URLs until Ctrl-C",
                           description="Start local sandboxes, print one JSON line per sandbox "
                                       "({url, token}) and keep them up until Ctrl-C.")
    boxes.add_argument("-n", type=positive_int, default=1, help="how many sandboxes")
    boxes.add_argument("--display", choices=DISPLAYS, default="virtual", help=DISPLAY_HELP)
    boxes.add_argument("--provider", default="local", metavar="TYPE|JSON|@FILE", help=PROVIDER_HELP)
    return parser


def _sandboxes(args: argparse.Namespace) -> int:
    from shinken_sync.demo import provider_config
    from shinken_sync.providers.config import make_provider

    with make_provider(provider_config(args.provider, args.display)) as provider:
        for handle in provider.create_many(args.n):
            url, token = provider.endpoint(handle)
            print(json.dumps({"url": url, "token": token}), flush=True)
        print("Ctrl-C stops them.", file=sys.stderr)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


def _check_demo_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every demo option applies to the run, or is refused saying why (never silently ignored)."""
    if not args.ray:
        given = [flag for flag in RAY_ONLY if getattr(args, flag[2:].replace("-", "_")) is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            parser.error(f"{', '.join(given)} {verb} in Ray mode only; add --ray auto|ADDRESS, or drop "
                         f"{'it' if len(given) == 1 else 'them'} (without --ray the demo starts its own "
                         f"session server and drives every episode from this process)")
    else:
        given = [flag for flag in ENGINE_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None]
        if given:
            verb = "configures" if len(given) == 1 else "configure"
            parser.error(f"{', '.join(given)} {verb} the session server the demo starts without --ray; "
                         f"Ray mode's driver actors send screenshots, which only an image-taking dialect "
                         f"(sglang) accepts: start a session server in front of such an engine "
                         f"(shinken-session-server --backend-url ...) and pass it with --session-server")
    if args.backend_kind is not None:
        from webapp.settings import BY_NAME

        kinds = BY_NAME["backend_kind"].choices or ()
        if args.backend_kind not in kinds:
            parser.error(f"--backend-kind {args.backend_kind!r}: one of {', '.join(kinds)}")
    if args.ray and args.session_server is not None:
        given = [flag for flag in ("--workers", "--port") if getattr(args, flag[2:]) is not None]
        if given:
            verb = "configures" if len(given) == 1 else "configure"
            parser.error(f"{', '.join(given)} {verb} the session server the demo starts; with "
                         f"--session-server it starts none: drop {', '.join(given)} or --session-server")
    args.workers = DEMO_WORKERS if args.workers is None else args.workers
    args.port = 0 if args.port is None else args.port


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        _check_demo_options(parser.chosen_command(args), args)
    from shinken_sync.demo import DemoError, check_display, run
    from shinken_sync.errors import ShinkenError

    try:
        if args.command == "demo" and args.ray:  # the rollout over a Ray cluster
            from shinken_sync.demo import ray_cluster

            return ray_cluster.run(args)
        if args.command == "demo":
            return run(args)
        check_display(args.display)
        return _sandboxes(args)
    except (DemoError, ShinkenError) as exc:
        print(f"shinken {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
