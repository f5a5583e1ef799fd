"""shinkend: the in-sandbox ACI daemon (``python -m shinken_sync.daemon.server``).

Binds, prints exactly one JSON line to stdout once every sandbox accepts
connections, then serves until SIGTERM/SIGINT::

    {"event": "ready", "url": "ws://127.0.0.1:PORT/sb/0", "pid": 1234, ...}

Everything else goes to stderr. Each sandbox is served on its own URL path
``/sb/<index>``: ``/sb/0`` in single mode, ``/sb/0`` .. ``/sb/N-1`` with
``--fleet N`` (N virtual sandboxes in one process sharing one encode cache,
for scale tests). One bearer token guards them all, read from ``--token-file``
(a regular file the group and others cannot read), from ``--token-fd`` (a pipe
read to EOF, what the providers use: the token is then in no file, argument or
environment) or, without either, from the ``SHINKEND_TOKEN`` environment
variable (moved into a pipe at once and the daemon re-executed without it, so
neither ``exec`` children nor ``/proc/PID/environ`` see it). Never from the
command line, where ``ps`` shows it. ``--unix PATH`` serves on a unix socket
instead of TCP; ``--exec-user`` runs the agent's processes apart from the
daemon (daemon/identity.py). docs/protocol.md is the reference.

Exit codes: 0 after a clean shutdown, 2 for bad command-line options or a token
that cannot be used (missing, unreadable, empty, shorter than
:data:`MIN_TOKEN_BYTES`, or in a file readable by group/others), 3 when a display
could not be started or the address could not be bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import http
import json
import logging
import math
import os
import re
import resource
import shlex
import signal
import stat
import sys
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve, unix_serve
from websockets.http11 import Request, Response

from shinken_sync import cliargs
from shinken_sync.protocol import MAX_MESSAGE_SIZE, PROTOCOL_VERSION, quote, unix_url

from . import identity
from .connection import serve_connection
from .display import DisplayError, make_display
from .display.desktop import DESKTOPS
from .screencast import DEFAULT_GRACE_S, StreamRegistry
from .verbs import SandboxState

log = logging.getLogger("shinkend")

EXIT_USAGE = 2
EXIT_BOOT_ERROR = 3
MAX_FLEET = 4096
MAX_RTT_MS = 10_000
#: How long shutdown waits for the displays to stop.
SHUTDOWN_TIMEOUT_S = 10.0
#: The closing handshake's bound (the SDK's too): a client that does not answer
#: the close frame is dropped after it, so SIGTERM never waits on one.
CLOSE_TIMEOUT_S = 2.0
#: How long shutdown waits for connections; handshakes still incomplete then
#: (they would have 10 s) are dropped with the process.
CONNECTIONS_SHUTDOWN_S = CLOSE_TIMEOUT_S + 1.0
#: Incoming frames buffered per connection before websockets stops reading;
#: the reader drains them into the call queue at once, so a few suffice.
WS_MAX_QUEUE = 4
#: A shorter bearer token is refused: it could be guessed over loopback.
MIN_TOKEN_BYTES = 16
TOKEN_ENV = "SHINKEND_TOKEN"

# At most 4 digits (MAX_FLEET): a longer index is simply not a sandbox, and
# never reaches int(), which refuses 4,300+ digits with an exception.
_PATH = re.compile(r"/sb/(\d{1,4})")


def sandbox_path(index: int) -> str:
    return f"/sb/{index}"


class Daemon:
    def __init__(self, sandboxes: list[SandboxState], token: str, rtt_ms: float):
        self.sandboxes = sandboxes
        self._expected = f"Bearer {token}".encode()
        self._delay_s = rtt_ms / 1000

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        values = request.headers.get_all("Authorization")
        given = values[0].encode("utf-8", "surrogateescape") if len(values) == 1 else b""
        if not hmac.compare_digest(given, self._expected):
            response = connection.respond(http.HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token\n")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if self._sandbox_for(request.path) is None:
            return connection.respond(http.HTTPStatus.NOT_FOUND, f"no sandbox at {quote(request.path)}\n")
        return None

    def _sandbox_for(self, path: str) -> SandboxState | None:
        match = _PATH.fullmatch(path.split("?", 1)[0])
        if match is None or int(match.group(1)) >= len(self.sandboxes):
            return None
        return self.sandboxes[int(match.group(1))]

    async def handle(self, ws: ServerConnection) -> None:
        assert ws.request is not None  # the handshake is done: websockets set it
        sandbox = self._sandbox_for(ws.request.path)
        assert sandbox is not None  # process_request refused every other path
        await serve_connection(ws, sandbox, self._delay_s)

    async def close(self) -> None:
        await asyncio.gather(*(sb.close() for sb in self.sandboxes), return_exceptions=True)


def _parse_screen(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match or not (16 <= int(match.group(1)) <= 16384 and 16 <= int(match.group(2)) <= 16384):
        raise argparse.ArgumentTypeError(f"screen must be WIDTHxHEIGHT between 16 and 16384, not {text!r}")
    return int(match.group(1)), int(match.group(2))


def build_parser() -> argparse.ArgumentParser:
    p = cliargs.Parser(prog="shinkend", description="The Shinken in-sandbox ACI daemon.", version=True)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; keep loopback unless a network in front authenticates "
                        "(default: 127.0.0.1)")
    p.add_argument("--port", type=cliargs.port, default=0, help="port to listen on; 0 picks a free one (default: 0)")
    p.add_argument("--token-file", default=None,
                   help=f"file holding the bearer token (at least {MIN_TOKEN_BYTES} bytes), mode 0600 or "
                        f"stricter (default: ${TOKEN_ENV}, the same rule)")
    p.add_argument("--token-fd", type=int, default=None, metavar="FD",
                   help="read the bearer token from this inherited descriptor (a pipe) up to EOF, then close "
                        "it: no path, no environment variable (default: off)")
    p.add_argument("--unix", default=None, metavar="PATH",
                   help="listen on this unix socket instead of --host/--port (its directory should be "
                        "private: mode 0700); the ready line's url is ws+unix://... (default: off)")
    p.add_argument("--exec-user", default=None, metavar="UID[:GID]",
                   help="run exec children (and programs launched for the agent) as this uid/gid, apart from "
                        "the daemon, which also makes itself the first OOM victim (isolated sandboxes; "
                        "see daemon/identity.py) (default: as the daemon)")
    p.add_argument("--exec-home", default="/home/agent", metavar="DIR",
                   help="with --exec-user: the agent's home, created if missing and its default cwd")
    p.add_argument("--display", choices=("virtual", "xvfb"), default="virtual",
                   help="virtual: a drawn desktop in this process; xvfb: a real X server with xdotool input "
                        "(needs Xvfb, xdotool and the [xvfb] extra) (default: virtual)")
    p.add_argument("--screen", type=_parse_screen, default=(1920, 1080), help="WIDTHxHEIGHT (default: 1920x1080)")
    p.add_argument("--fleet", type=cliargs.non_negative_int, default=0, metavar="N", help="serve N virtual sandboxes from this process (default: 0, one sandbox)")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="hold every outgoing message this long, emulating a WAN round trip (default: 0)")
    p.add_argument("--sandbox-id", default="", help="id reported in hello (fleet: prefix, '-<index>' added) (default: shinkend-<pid>)")
    p.add_argument("--stream-grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                   help="how long a detached screencast waits for resume_screencast (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="virtual desktop content seed (default: 0)")
    p.add_argument("--launch", default="", metavar="COMMAND",
                   help="xvfb: start this program on the screen once it is up (e.g. xterm) and focus it "
                        "(default: none)")
    p.add_argument("--desktop", choices=tuple(DESKTOPS), default=None,
                   help="xvfb: a real desktop on the screen: "
                        + "; ".join(f"{d.name}: {d.description}" for d in DESKTOPS.values())
                        + " (docs/desktop.md) (default: none, a bare screen)")
    p.add_argument("--log-level", default="INFO",
                   help="stderr log threshold: DEBUG, INFO, WARNING or ERROR (default: INFO)")
    return p


class TokenError(Exception):
    """The bearer token cannot be used; the daemon exits with :data:`EXIT_USAGE`."""


def _read_token(path: str | None, fd: int | None = None) -> str:
    # Popped whether used or not: exec children inherit os.environ and must
    # never see a token.
    from_env = os.environ.pop(TOKEN_ENV, "").strip()
    if fd is not None:
        where = f"token descriptor {fd}"
        raw = _read_token_fd(fd, where)
    elif path is None:
        where = f"${TOKEN_ENV}"
        if not from_env:
            raise TokenError(f"no token: pass --token-file PATH, --token-fd FD or set {where}")
        raw = from_env.encode("utf-8", "surrogateescape")
    else:
        where = f"token file {path}"
        raw = _read_token_file(path, where)
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise TokenError(f"{where} is not UTF-8 text") from None
    if not token:
        raise TokenError(f"{where} is empty")
    if len(token.encode()) < MIN_TOKEN_BYTES:
        raise TokenError(f"the token in {where} is shorter than {MIN_TOKEN_BYTES} bytes")
    return token


def _read_token_fd(fd: int, where: str) -> bytes:
    # Read to EOF and closed: nothing of the token stays reachable through this descriptor.
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read(64 * 2**10)
    except OSError as exc:
        raise TokenError(f"cannot read {where}: {exc.strerror or exc}") from None


def _read_token_file(path: str, where: str) -> bytes:
    try:
        # O_NONBLOCK: a FIFO planted at the path must not hang the start.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise TokenError(f"cannot open {where}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TokenError(f"{where} is not a regular file")
        if info.st_mode & 0o077:
            raise TokenError(
                f"{where} is readable or writable by group/others (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"chmod 600 it"
            )
        return f.read(64 * 2**10)


async def _make_sandboxes(args: argparse.Namespace) -> list[SandboxState]:
    width, height = args.screen
    base_id = args.sandbox_id or f"shinkend-{os.getpid()}"
    if args.fleet:
        from .display.virtual import SharedFrameCache

        cache = SharedFrameCache()
        # One seed for the whole fleet: one shared scene, and sandboxes in the same
        # state share encoded frames.
        specs = [(f"{base_id}-{i}", {"seed": args.seed, "shared_cache": cache}) for i in range(args.fleet)]
    else:
        options: dict[str, Any] = {"seed": args.seed} if args.display == "virtual" else {}
        if args.launch:
            options["launch"] = shlex.split(args.launch)
        if args.desktop:
            options["desktop"] = args.desktop
        specs = [(base_id, options)]
    sandboxes: list[SandboxState] = []
    try:
        for sandbox_id, options in specs:
            display = make_display(args.display, width, height, **options)
            sandboxes.append(SandboxState(sandbox_id, display, StreamRegistry(display, args.stream_grace)))
            await display.start()
    except BaseException:
        await asyncio.gather(*(sb.close() for sb in sandboxes), return_exceptions=True)
        raise
    x_display = getattr(sandboxes[0].display, "display_name", None)
    if x_display and not args.fleet:
        # exec's commands (xdotool, a program the agent starts itself) reach this screen.
        os.environ["DISPLAY"] = x_display
    return sandboxes


async def run(args: argparse.Namespace, token: str) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        sandboxes = await _make_sandboxes(args)
    except DisplayError as exc:  # says what failed, with the fix or the program's log tail
        log.error("could not start the %s display: %s", args.display, exc)
        return EXIT_BOOT_ERROR
    except Exception:
        log.exception("could not start the %s display", args.display)
        return EXIT_BOOT_ERROR
    daemon = Daemon(sandboxes, token, args.rtt_ms)
    server: Server | None = None
    try:
        options: dict[str, Any] = {
            "process_request": daemon.process_request,
            "compression": None,
            "max_size": MAX_MESSAGE_SIZE,
            "max_queue": WS_MAX_QUEUE,
            "close_timeout": CLOSE_TIMEOUT_S,
            "logger": logging.getLogger("shinkend.ws"),
        }
        where = args.unix or f"{args.host}:{args.port}"
        try:
            if args.unix:
                server = await unix_serve(daemon.handle, args.unix, **options)
            else:
                server = await serve(daemon.handle, args.host, args.port, **options)
        except OSError as exc:
            log.error("cannot listen on %s: %s", where, exc)
            return EXIT_BOOT_ERROR
        if args.unix:
            port = None
            urls = [unix_url(args.unix, sandbox_path(i)) for i in range(len(sandboxes))]
        else:
            port = server.sockets[0].getsockname()[1]
            host = f"[{args.host}]" if ":" in args.host else args.host
            urls = [f"ws://{host}:{port}{sandbox_path(i)}" for i in range(len(sandboxes))]
        display = sandboxes[0].display
        ready: dict[str, Any] = {
            "event": "ready",
            "url": urls[0],
            "pid": os.getpid(),
            "port": port,
            "protocol": PROTOCOL_VERSION,
            "display": args.display,
            "screen": {"width": display.width, "height": display.height},
            "sandbox_id": sandboxes[0].sandbox_id,
            "rtt_ms": args.rtt_ms,
        }
        x_display = getattr(display, "display_name", None)
        if x_display:
            ready["x_display"] = x_display
        desktop = getattr(display, "desktop_status", None)
        if desktop:
            ready["desktop"] = desktop
        if args.fleet:
            ready["urls"] = urls
        sys.stdout.write(json.dumps(ready) + "\n")
        sys.stdout.flush()
        log.info("serving %d sandbox(es) on %s", len(sandboxes), urls[0] if len(urls) == 1 else f"port {port}")
        await stop.wait()
        log.info("shutting down")
    finally:
        if server is not None:
            server.close()
            try:
                await asyncio.wait_for(server.wait_closed(), CONNECTIONS_SHUTDOWN_S)
            except asyncio.TimeoutError:  # noqa: UP041 (not TimeoutError on 3.10)
                log.warning("connections still open after %.0f s; closing anyway", CONNECTIONS_SHUTDOWN_S)
        try:
            await asyncio.wait_for(daemon.close(), SHUTDOWN_TIMEOUT_S)
        except asyncio.TimeoutError:  # noqa: UP041 (not TimeoutError on 3.10)
            log.warning("displays still closing after %.0f s; exiting anyway", SHUTDOWN_TIMEOUT_S)
    return 0


def _raise_fd_limit() -> None:
    # A fleet host holds a socket per connection; the usual soft limit of 1024
    # is exactly one connection per sandbox of a 1024 fleet, with no headroom.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _reexec_with_token_pipe() -> None:
    """Move a ``$SHINKEND_TOKEN`` into a pipe and execute this daemon again without it.

    The kernel keeps a process's initial environment in ``/proc/PID/environ`` whatever
    ``os.environ`` becomes, so popping the variable hid it from children only. Run from
    the command line only (never replaces a process that called :func:`main`)."""
    token = os.environ.pop(TOKEN_ENV).encode("utf-8", "surrogateescape")
    read_end, write_end = os.pipe()
    os.write(write_end, token[: 60 * 2**10])  # fits a pipe's buffer; longer is no token anyway
    os.close(write_end)
    os.set_inheritable(read_end, True)
    os.execv(sys.executable, [sys.executable, "-m", "shinken_sync.daemon.server", *sys.argv[1:],
                              "--token-fd", str(read_end)])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None and args.token_file is None and args.token_fd is None and os.environ.get(TOKEN_ENV):
        _reexec_with_token_pipe()
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="%(asctime)s shinkend[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    # One INFO line per connection is noise at a thousand connections.
    logging.getLogger("shinkend.ws").setLevel(max(logging.WARNING, logging.getLogger().level))
    if args.fleet and args.display != "virtual":
        parser.error("--fleet serves virtual sandboxes only (use --display virtual)")
    if not 0 <= args.fleet <= MAX_FLEET:
        parser.error(f"--fleet must be between 1 and {MAX_FLEET}")
    if not 0 <= args.rtt_ms <= MAX_RTT_MS:
        parser.error(f"--rtt-ms must be between 0 and {MAX_RTT_MS}")
    if args.launch and args.display != "xvfb":
        parser.error("--launch needs --display xvfb")
    if args.desktop and args.display != "xvfb":
        parser.error("--desktop needs --display xvfb")
    if not 0 <= args.stream_grace < math.inf:  # NaN fails both: a NaN timer breaks the loop's heap
        parser.error("--stream-grace must be a finite number >= 0")
    _raise_fd_limit()
    try:
        token = _read_token(args.token_file, args.token_fd)
    except TokenError as exc:
        log.error("refusing to start: %s", exc)
        return EXIT_USAGE
    # The token is in this process's memory now: no other uid may read it.
    identity.harden_daemon(oom_first=args.exec_user is not None)
    if args.exec_user is not None:
        try:
            uid, gid = identity.parse_exec_user(args.exec_user)
        except ValueError as exc:
            parser.error(str(exc))
        user = identity.AgentUser(uid, gid, args.exec_home)
        try:
            identity.prepare_home(user)
        except OSError as exc:
            log.error("cannot prepare the agent's home %s: %s", user.home, exc)
            return EXIT_BOOT_ERROR
        identity.set_agent(user)
    return asyncio.run(run(args, token))


if __name__ == "__main__":
    sys.exit(main())
