"""``shinken-session-server``: run the session server under gunicorn (gevent worker class).

::

    shinken-session-server --workers N [--backend-url URL] [--bind HOST:PORT]
                           [--tokenizer PATH] [--api-key KEY]
                           [--routing-replay-layers L] [--indexer-replay] [--instance TAG]
    shinken-session-server nginx-config TAG=HOST:PORT ... [--listen ADDR] [--full PREFIX] [--out FILE]

``--workers N`` (N >= 1) serves the thin router (``webapp.router:create_app()``) with N
session worker subprocesses; ``--workers 0`` serves the single-process app
(``webapp.app:create_app()``) under the same gunicorn. Without ``--backend-url`` the
reference backend is started as the embedded default. This process binds the listening
socket itself (so ``--bind 127.0.0.1:0`` works), hands it to gunicorn as ``fd://``, waits
until ``/health`` answers 200, then prints one JSON line on stdout::

    {"ready": true, "url": "http://127.0.0.1:PORT", "workers": N, "backend_url": "...", "pid": ...}

SIGTERM, SIGINT and SIGHUP become a graceful SIGTERM to gunicorn; when it exits, the embedded backend is stopped and
this process exits with gunicorn's exit code (see docs/session-server-ops.md). Whatever this
process starts dies with it however it dies, SIGKILL included (:mod:`shinken_sync.lifetime`):
gunicorn gets SIGTERM from the kernel, its router worker in turn (``gunicorn.conf.py``), the
session workers SIGKILL from theirs, and the reference backend watches its parent pid. A usage
error (a taken port, a bad number) is one line on stderr and exit code 2.

``--instance TAG`` makes this server one of several behind nginx: its session ids start with
``TAG-``, and ``nginx-config`` prints the nginx config routing each id to its owner
(:mod:`webapp.scaleout`, docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from shinken_sync.cliargs import Parser, non_negative_int
from shinken_sync.lifetime import parent_death_preexec
from webapp.scaleout import INSTANCE_ENV, INSTANCE_PATTERN
from webapp.settings import parse_bind

__all__ = ["READY_URL_PATTERN", "main", "server_argv"]

CONF_PATH = Path(__file__).with_name("gunicorn.conf.py")
READY_TIMEOUT = 120.0
EXIT_NOT_READY = 3  # gunicorn died or /health never turned 200 before READY_TIMEOUT
_POLL = 0.05
# Matches the ready line's URL (group 1); for launchers that read this process's stdout.
READY_URL_PATTERN = r'"ready": true, "url": "(http://[^"]+)"'


def server_argv(workers: int, backend_url: str | None = None, bind: str = "127.0.0.1:0",
                *extra: str) -> list[str]:
    """The command line that runs this server (tests and benchmarks start it this way)."""
    argv = [sys.executable, "-m", "webapp.serve", "--workers", str(workers), "--bind", bind, *extra]
    return argv + (["--backend-url", backend_url] if backend_url else [])


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _health_ok(host: str, port: int) -> bool:
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    conn = http.client.HTTPConnection(connect_host, port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="shinken-session-server",
                    description="Run the Shinken session server (router + session workers) under gunicorn.")
    parser.add_argument("--workers", type=non_negative_int, default=1,
                        help="session worker processes (0: the single-process server)")
    parser.add_argument("--backend-url", default=None,
                        help="inference backend base URL (default: start the embedded reference backend)")
    parser.add_argument("--bind", default="127.0.0.1:8000", type=parse_bind,
                        help="HOST:PORT to listen on; port 0 picks a free one (default: 127.0.0.1:8000)")
    parser.add_argument("--tokenizer", default=None,
                        help="dir with tokenizer.json + chat template (default: the byte tokenizer)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on all routes but /health, router mode only "
                             "(default: $SHINKEN_API_KEY, else no key)")
    parser.add_argument("--reference-r3-layers", type=non_negative_int, default=4,
                        help="routed-expert layers the embedded reference backend returns per token "
                             "(0: none; ignored with --backend-url)")
    parser.add_argument("--routing-replay-layers", type=non_negative_int, default=None,
                        help="routing replay (R3): ask the backend for routed_experts; the model's MoE "
                             "layer count, which /samples shapes R3 with (0: off; default: off, or "
                             "--reference-r3-layers with the embedded reference backend)")
    parser.add_argument("--indexer-replay", action="store_true",
                        help="indexer replay: ask the backend for indexer_topk (default: off)")
    parser.add_argument("--heartbeat-timeout", type=float, default=None,
                        help="seconds a session worker may miss heartbeats before it is restarted "
                             "(default: $SHINKEN_HEARTBEAT_TIMEOUT, else the built-in setting)")
    parser.add_argument("--read-timeout", type=float, default=None,
                        help="backend read timeout per turn, seconds "
                             "(default: $SHINKEN_READ_TIMEOUT, else the built-in setting)")
    parser.add_argument("--instance", default=None,
                        help="instance tag ([a-z0-9]{1,16}) minted into session ids, for several servers "
                             "behind nginx (see `shinken-session-server nginx-config -h`); router mode only "
                             "(default: none, untagged ids)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["nginx-config"]:
        from webapp import scaleout

        return scaleout.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.instance is not None:
        if args.workers == 0:
            parser.error("--instance is minted by the router: use --workers >= 1")
        if not INSTANCE_PATTERN.fullmatch(args.instance):
            parser.error(f"--instance must match {INSTANCE_PATTERN.pattern}, got {args.instance!r}")
    host, port = args.bind
    api_key = args.api_key or os.environ.get("SHINKEN_API_KEY") or None
    if api_key and args.workers == 0:
        parser.error("--api-key is enforced by the router: use --workers >= 1")
    # Bound before anything starts: a taken port is a one-line usage error, not a traceback
    # after the backend is already up.
    try:
        listener = _listen(host, port)
    except OSError as exc:
        parser.error(f"cannot listen on {host}:{port}: {exc.strerror}; pass --bind with a free port (or port 0)")
    port = listener.getsockname()[1]
    backend = None
    backend_url = args.backend_url
    replay_layers = args.routing_replay_layers
    if backend_url is None:
        from webapp.reference_backend import start_reference_backend

        # R3 on by default, so the embedded setup exercises the routed-expert path end to end.
        backend = start_reference_backend(tokenizer=args.tokenizer, r3_layers=args.reference_r3_layers)
        backend_url = backend.url
        if replay_layers is None:
            replay_layers = args.reference_r3_layers
    env = dict(os.environ, SHINKEN_BACKEND_URL=backend_url, SHINKEN_WORKERS=str(args.workers))
    env.pop("SHINKEN_API_KEY", None)
    env.pop(INSTANCE_ENV, None)
    for name, value in (("SHINKEN_TOKENIZER", args.tokenizer), ("SHINKEN_API_KEY", api_key),
                        ("SHINKEN_HEARTBEAT_TIMEOUT", args.heartbeat_timeout),
                        ("SHINKEN_READ_TIMEOUT", args.read_timeout), (INSTANCE_ENV, args.instance),
                        ("SHINKEN_ROUTING_REPLAY_LAYERS", replay_layers),
                        ("SHINKEN_INDEXER_REPLAY", "1" if args.indexer_replay else None)):
        if value is not None:
            env[name] = str(value)
    app_uri = "webapp.router:create_app()" if args.workers else "webapp.app:create_app()"
    argv_gunicorn = [sys.executable, "-m", "gunicorn", "-c", str(CONF_PATH), "--bind", f"fd://{listener.fileno()}",
                     "--no-control-socket", "--worker-class", "gevent", "--workers", "1", app_uri]
    # gunicorn dies with this process however it dies (SIGTERM: a graceful stop of its worker, which
    # stops the session workers); this process is single-threaded here, see shinken_sync.lifetime.
    gunicorn = subprocess.Popen(argv_gunicorn, env=env, pass_fds=[listener.fileno()], stdin=subprocess.DEVNULL,
                                preexec_fn=parent_death_preexec(signal.SIGTERM))  # noqa: PLW1509
    listener.close()

    def forward(signum: int, _frame: object) -> None:
        # Every stop signal becomes gunicorn's graceful SIGTERM: its SIGHUP would reload, which
        # replaces the router and so every session worker (all sessions lost).
        if gunicorn.poll() is None:
            gunicorn.send_signal(signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while not _health_ok(host, port):
            if gunicorn.poll() is not None or time.monotonic() > deadline:
                print(json.dumps({"ready": False, "error": "gunicorn exited or /health never answered 200"}),
                      flush=True)
                if gunicorn.poll() is None:
                    gunicorn.terminate()
                    gunicorn.wait(30)
                return EXIT_NOT_READY
            time.sleep(_POLL)
        url_host = f"[{host}]" if ":" in host else host
        print(json.dumps({"ready": True, "url": f"http://{url_host}:{port}", "workers": args.workers,
                          "backend_url": backend_url, "pid": os.getpid(), "instance": args.instance}),
              flush=True)
        return gunicorn.wait()
    finally:
        if gunicorn.poll() is None:
            gunicorn.terminate()
            try:
                gunicorn.wait(30)
            except subprocess.TimeoutExpired:
                gunicorn.kill()
                gunicorn.wait()
        if backend is not None:
            backend.close()


if __name__ == "__main__":
    sys.exit(main())
