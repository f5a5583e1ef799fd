"""``shinken-session-server``: run the session server under gunicorn (gevent worker class).

::

    shinken-session-server --workers N [--backend-url URL] [--bind HOST:PORT]
                           [--tokenizer PATH] [--api-key-file PATH] [--max-prompt-tokens N]
                           [--max-message-bytes N] [--max-sessions N] [--session-idle-ttl S]
                           [--routing-replay-layers L] [--indexer-replay] ...

``--workers N`` (N >= 1) serves the thin router (``webapp.router:create_app()``) with N
session worker subprocesses; ``--workers 0`` serves the single-process app
(``webapp.app:create_app()``) under the same gunicorn. Without ``--backend-url`` the
reference backend is started as the embedded default, and restarted whenever it exits. This process binds the listening
socket itself (so ``--bind 127.0.0.1:0`` works), hands it to gunicorn as ``fd://``, waits
until ``/health`` answers 200, then prints one JSON line on stdout::

    {"ready": true, "url": "http://127.0.0.1:PORT", "workers": N, "backend_url": "...", "pid": ...}

SIGTERM, SIGINT and SIGHUP become a graceful SIGTERM to gunicorn; when it exits, the embedded backend is stopped and
this process exits with gunicorn's exit code (see docs/session-server-ops.md). Whatever this
process starts dies with it however it dies, SIGKILL included (:mod:`shinken_sync.lifetime`):
gunicorn gets SIGTERM from the kernel, its router worker in turn (``gunicorn.conf.py``), the
session workers SIGKILL from theirs, and the reference backend watches its parent pid. A usage
error (a taken port, a bad number) is one line on stderr and exit code 2.
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
from typing import TYPE_CHECKING

from shinken_sync.cliargs import Parser, non_negative_int
from shinken_sync.lifetime import parent_death_preexec
from webapp.backend_liveness import SupervisedBackend
from webapp.http_limits import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_CLIENT_CONNECTIONS
from webapp.images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGES
from webapp.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_IDLE_TTL,
)
from webapp.settings import parse_bind

if TYPE_CHECKING:
    from webapp.reference_backend import ReferenceBackendProcess

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


# Numeric settings passed on as SHINKEN_<DEST> (upper case): the router (RouterConfig) and the
# single-process app (CoreConfig) both read them from the environment, so each works in both modes.
_ENV_SETTINGS: tuple[tuple[str, type, str], ...] = (
    ("--heartbeat-timeout", float, ("seconds a session worker may miss heartbeats (with no CPU progress) "
                                   "before it is restarted; router mode (default: the built-in setting)")),
    ("--busy-timeout", float, ("seconds a session worker may miss heartbeats while using CPU before it is "
                              "restarted; router mode (default 600)")),
    ("--read-timeout", float, "backend read timeout per turn, seconds (default: the built-in setting)"),
    ("--max-message-bytes", int, (f"413 for a message whose text is over this many UTF-8 bytes "
                                 f"(default {DEFAULT_MAX_MESSAGE_BYTES})")),
    ("--max-prompt-tokens", int, (f"413 for a turn whose prompt is over this many tokens "
                                 f"(default {DEFAULT_MAX_PROMPT_TOKENS})")),
    ("--max-sessions", int, (f"429 for a new session past this many live ones per worker "
                            f"(default {DEFAULT_MAX_SESSIONS})")),
    ("--body-timeout", float, (f"408 for a request body not received within this many seconds "
                              f"(default {DEFAULT_BODY_TIMEOUT:g})")),
    ("--max-client-connections", int, (f"429 for a connection past this many open ones from one client "
                                      f"address (default {DEFAULT_MAX_CLIENT_CONNECTIONS})")),
    ("--max-image-bytes", int, (f"400 for an image over this many (decoded) bytes "
                               f"(default {DEFAULT_MAX_IMAGE_BYTES})")),
    ("--max-images", int, f"400 for a request with more images than this (default {DEFAULT_MAX_IMAGES})"),
    ("--session-idle-ttl", float, (f"seconds after which a session nobody used is deleted "
                                  f"(default {DEFAULT_SESSION_IDLE_TTL:g})")),
)


def _env_name(flag: str) -> str:
    return "SHINKEN_" + flag.lstrip("-").replace("-", "_").upper()


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
    parser.add_argument("--api-key-file", default=None, type=Path,
                        help="require 'Authorization: Bearer KEY' on all routes but /health, KEY being "
                             "this file's content (owner-only permissions; router mode only). "
                             "Or set $SHINKEN_API_KEY (default: no key)")
    parser.add_argument("--api-key", default=None,
                        help="the key itself: visible to every user in ps, so deprecated "
                             "(use --api-key-file or $SHINKEN_API_KEY)")
    parser.add_argument("--reference-r3-layers", type=non_negative_int, default=4,
                        help="routed-expert layers the embedded reference backend returns per token "
                             "(0: none; ignored with --backend-url)")
    parser.add_argument("--routing-replay-layers", type=non_negative_int, default=None,
                        help="routing replay (R3): ask the backend for routed_experts; the model's MoE "
                             "layer count, which /samples shapes R3 with (0: off; default: off, or "
                             "--reference-r3-layers with the embedded reference backend)")
    parser.add_argument("--indexer-replay", action="store_true",
                        help="indexer replay: ask the backend for indexer_topk (default: off)")
    for flag, kind, help_text in _ENV_SETTINGS:
        parser.add_argument(flag, type=kind, default=None, help=help_text)
    return parser


class ApiKeyFileError(ValueError):
    """The ``--api-key-file`` cannot be used: unreadable, empty, or readable by others."""


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from ``--api-key-file``, ``--api-key`` (with a warning: anyone can read it in
    ``ps``, so the flag is scrubbed from this process's title) or ``$SHINKEN_API_KEY``."""
    if args.api_key_file is not None and args.api_key is not None:
        raise ApiKeyFileError("give --api-key-file or --api-key, not both")
    if args.api_key_file is not None:
        try:
            mode = args.api_key_file.stat().st_mode
            key = args.api_key_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeyFileError(f"--api-key-file: cannot read {args.api_key_file}: {exc}") from None
        if mode & 0o077:
            raise ApiKeyFileError(f"--api-key-file: {args.api_key_file} is readable by other users "
                                  f"(mode {mode & 0o777:o}); chmod 600 it")
        if not key:
            raise ApiKeyFileError(f"--api-key-file: {args.api_key_file} is empty")
        return key
    if args.api_key is not None:
        print("warning: --api-key shows the key to every user of this machine (ps); "
              "use --api-key-file or SHINKEN_API_KEY", file=sys.stderr, flush=True)
        _scrub_title(args.api_key)
        return args.api_key or None
    return os.environ.get("SHINKEN_API_KEY") or None


def _scrub_title(secret: str) -> None:
    # Rewrites /proc/self/cmdline, which ps reads; the key was visible only until now.
    import setproctitle

    setproctitle.setproctitle(" ".join(arg.replace(secret, "***") for arg in sys.orig_argv))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    host, port = args.bind
    try:
        api_key = _api_key(args)
    except ApiKeyFileError as exc:
        parser.error(str(exc))
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

        def start_backend(bind: str | None) -> ReferenceBackendProcess:
            # R3 on by default, so the embedded setup exercises the routed-expert path end to end.
            return start_reference_backend(tokenizer=args.tokenizer, r3_layers=args.reference_r3_layers,
                                           **({"bind": bind} if bind else {}))

        # Restarted on the same address whenever it dies: the workers keep its URL.
        backend = SupervisedBackend(start_backend)
        backend_url = backend.url
        if replay_layers is None:
            replay_layers = args.reference_r3_layers
    env = dict(os.environ, SHINKEN_BACKEND_URL=backend_url, SHINKEN_WORKERS=str(args.workers))
    env.pop("SHINKEN_API_KEY", None)
    settings = [(_env_name(flag), getattr(args, _env_name(flag)[len("SHINKEN_"):].lower()))
                for flag, _kind, _help in _ENV_SETTINGS]
    for name, value in (("SHINKEN_TOKENIZER", args.tokenizer), ("SHINKEN_API_KEY", api_key), *settings,
                        ("SHINKEN_ROUTING_REPLAY_LAYERS", replay_layers),
                        ("SHINKEN_INDEXER_REPLAY", "1" if args.indexer_replay else None)):
        if value is not None:
            env[name] = str(value)
    app_uri = "webapp.router:create_app()" if args.workers else "webapp.app:create_app()"
    argv_gunicorn = [sys.executable, "-m", "gunicorn", "-c", str(CONF_PATH), "--bind", f"fd://{listener.fileno()}",
                     "--no-control-socket", "--worker-class", "webapp.gunicorn_worker.SessionServerWorker",
                     "--workers", "1", app_uri]
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
                          "backend_url": backend_url, "pid": os.getpid()}), flush=True)
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
