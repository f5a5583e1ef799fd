"""``shinken-session-server``: run the session server under gunicorn (gevent worker class).

::

    shinken-session-server --workers N [--backend-url URL] [--bind HOST:PORT]
                           [--tokenizer PATH] [--api-key-file PATH] [--<setting> VALUE] ...

Every setting of :data:`webapp.settings.SETTINGS` is a flag here and a ``SHINKEN_<NAME>``
variable (a flag wins); this process resolves them all and hands gunicorn, and so the router,
the single-process app and every session worker, the whole resolved set as ``SHINKEN_*``.
    shinken-session-server nginx-config TAG=HOST:PORT ... [--listen ADDR] [--full PREFIX] [--out FILE]

``--workers N`` (N >= 1) serves the thin router (``webapp.router:create_app()``) with N
session worker subprocesses; ``--workers 0`` serves the single-process app
(``webapp.app:create_app()``) under the same gunicorn. Without ``--backend-url`` the
reference backend is started as the embedded default, and restarted whenever it exits. This process binds the listening
socket itself (so ``--bind 127.0.0.1:0`` works), hands it to gunicorn as ``fd://``, waits
until ``/health`` answers 200, then prints one JSON line on stdout::

    {"ready": true, "url": "http://127.0.0.1:PORT", "workers": N, "backend_url": "...",
     "backend_kind": "sglang|vllm", "images": true, "pid": ...}

(``images``: whether the engine's dialect takes image parts; false for vLLM's completions API.)

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
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from shinken_sync.childproc import parse_ready_line
from shinken_sync.cliargs import Parser
from shinken_sync.lifetime import parent_death_preexec
from webapp.backend_liveness import SupervisedBackend
from webapp.datadir import DataDirInUse, DataDirUnsafe, check_free, default_data_dir
from webapp.engines import DIALECTS, EngineConfigError, ReplayRequest, dialect_for
from webapp.engines.probe import (
    BackendURLError,
    EngineCheckFailed,
    check_backend_url,
    check_vocabulary,
    resolve_kind,
    wait_for_engine,
)
from webapp.errors import WebappError
from webapp.matchers import UnknownMatcher, resolve_matcher
from webapp.settings import (
    BY_NAME,
    add_arguments,
    defaults,
    embedded_replay_layers,
    given_values,
    launcher_env,
    parse_bind,
)
from webapp.tokenizers import ChatTokenizer, TokenizerLoadError, load_tokenizer
from webapp.tree_samples import SampleHooks, SampleHookSelectorError

if TYPE_CHECKING:
    from webapp.reference_backend import ReferenceBackendProcess

__all__ = ["READY_URL_PATTERN", "SessionServerNotReady", "SessionServerProcess", "main", "server_argv",
           "start_session_server"]

_ServerT = TypeVar("_ServerT", bound="SessionServerProcess")

API_KEY_ENV = BY_NAME["api_key"].env_var or ""
CONF_PATH = Path(__file__).with_name("gunicorn.conf.py")
READY_TIMEOUT = 120.0
# gunicorn died, a shard's workers could not boot, or /health never turned 200 before READY_TIMEOUT
EXIT_NOT_READY = 3
_POLL = 0.05
_SAY_AFTER = 3.0  # seconds of /health not answering 200 before start-up says what it waits for
# Matches the ready line's URL (group 1); for launchers that read this process's stdout.
READY_URL_PATTERN = r'"ready": true, "url": "(http://[^"]+)"'


def gunicorn_version_flags() -> list[str]:
    """Command-line settings the installed gunicorn knows of those only some versions have.

    gunicorn 25.1 added a control socket (for ``gunicornc``), on by default; the launcher turns
    it off (nothing here uses it, and it is one more listening endpoint). Older gunicorns, which
    setup.py allows, have no such socket and refuse the flag: every start failed with
    "unrecognized arguments: --no-control-socket"."""
    from gunicorn.config import KNOWN_SETTINGS  # the master's settings table; imports no worker

    known = {setting.name for setting in KNOWN_SETTINGS}
    return ["--no-control-socket"] if "control_socket_disable" in known else []


def server_argv(workers: int, backend_url: str | None = None, bind: str = "127.0.0.1:0",
                *extra: str) -> list[str]:
    """The command line that runs this server (tests and benchmarks start it this way)."""
    argv = [sys.executable, "-m", "webapp.serve", "--workers", str(workers), "--bind", bind, *extra]
    return argv + (["--backend-url", backend_url] if backend_url else [])


class SessionServerNotReady(WebappError):
    """A session server started with :func:`start_session_server` did not become ready:
    ``exit_code`` (None: still running at the deadline, then stopped) and ``detail`` (its ready
    line's error, or the tail of its output) say why."""

    def __init__(self, message: str, exit_code: int | None, detail: str) -> None:
        super().__init__(f"{message}{f': {detail}' if detail else ''}")
        self.exit_code = exit_code
        self.detail = detail


class SessionServerProcess:
    """A ``shinken-session-server`` child process (see :func:`start_session_server`).

    It dies with this process however this process dies (``PR_SET_PDEATHSIG``: SIGTERM, a
    graceful stop), and so does everything it starts. Its stdout is read for the ready line
    (which reports the port it bound, so port 0 has no race); the rest of its output goes to
    ``log_path`` (or is discarded).
    """

    def __init__(self, argv: list[str], log_path: Path | None = None, *, own_session: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self._log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 (closed in close())
        self.log_path = log_path
        self._ready: dict[str, object] | None = None
        self._got_line = threading.Event()
        # own_session: a terminal's Ctrl-C then reaches only the caller, which stops it in order.
        self._proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=self._log or subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            env=env, start_new_session=own_session,
            preexec_fn=parent_death_preexec(signal.SIGTERM))  # noqa: PLW1509 (see shinken_sync.lifetime)
        self._reader = threading.Thread(target=self._read_stdout, name="session-server-stdout", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def url(self) -> str:
        """The base URL; only once :meth:`wait_ready` returned."""
        if self._ready is None:
            raise RuntimeError("the session server is not ready (call wait_ready first)")
        return str(self._ready["url"])

    @property
    def ready_line(self) -> dict[str, object]:
        """The launcher's ready line (``url``, ``workers``, ``instance``, ``pid``...); only once
        :meth:`wait_ready` returned."""
        if self._ready is None:
            raise RuntimeError("the session server is not ready (call wait_ready first)")
        return dict(self._ready)

    def _read_stdout(self) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:  # until the process (and gunicorn, which shares it) exits
            if not self._got_line.is_set():
                line = parse_ready_line(raw)
                if line is not None and "ready" in line:
                    self._ready = line
                    self._got_line.set()
                    continue
            if self._log is not None and not self._log.closed:
                self._log.write(raw)
        self._got_line.set()

    def wait_ready(self, timeout: float = READY_TIMEOUT + 10.0) -> str:
        """Wait for the ready line; returns the URL.

        Raises :class:`SessionServerNotReady` (the process stopped) when it exits, reports
        ``"ready": false`` or says nothing within ``timeout``.
        """
        if not self._got_line.wait(timeout):
            self.close()
            raise SessionServerNotReady(f"the session server was not ready after {timeout:.0f} s", None,
                                        self._tail())
        if self._ready is None or self._ready.get("ready") is not True:
            error = str(self._ready.get("error", "")) if self._ready else ""
            self._ready = None
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(30)  # it exits by itself after a "ready": false line
            code = self.close()
            raise SessionServerNotReady(f"the session server exited with code {code}", code,
                                        error or self._tail())
        return self.url

    def _tail(self) -> str:
        if self.log_path is None:
            return ""
        if self._log is not None and not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-2000:].strip()

    def close(self, timeout: float = 30.0) -> int | None:
        """Stop it gracefully (SIGTERM; SIGKILL after ``timeout``); returns its exit code."""
        _terminate(self._proc, timeout)
        self._reader.join(5)
        if self._log is not None:
            self._log.close()
        return self._proc.returncode

    def __enter__(self: _ServerT) -> _ServerT:  # noqa: PYI019 - no typing.Self on 3.10
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _terminate(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM (a graceful stop), then SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_session_server(workers: int = 1, backend_url: str | None = None, bind: str = "127.0.0.1:0",
                         *extra: str, log_path: Path | None = None, own_session: bool = False,
                         wait: bool = True, env: dict[str, str] | None = None) -> SessionServerProcess:
    """Start ``shinken-session-server`` with ``extra`` flags (``shinken demo``, the benches and
    tests that only need a running server start it this way; tests that read the server's whole
    output start the same :func:`server_argv` with their own reader); ``bind`` port 0 is bound
    by the server itself, which reports the port, so there is no free-port race.

    With ``wait`` (default) returns once it is ready (``.url``), else at once (then call
    :meth:`SessionServerProcess.wait_ready`). Raises :class:`SessionServerNotReady`.
    """
    server = SessionServerProcess(server_argv(workers, backend_url, bind, *extra), log_path,
                                  own_session=own_session, env=env)
    if wait:
        server.wait_ready()
    return server


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _health(host: str, port: int) -> tuple[bool, str | None, str | None]:
    """(/health answers 200, why it never will: the reason of shards whose workers could not
    boot, why it does not yet: its error, e.g. the backend is unreachable)."""
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    conn = http.client.HTTPConnection(connect_host, port, timeout=5)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        if response.status == 200:
            return True, None, None
        body = json.loads(response.read() or b"{}")
        error = str(body.get("error")) if isinstance(body, dict) and body.get("error") else None
        return False, (error if isinstance(body, dict) and body.get("failed_shards") else None), error
    except (OSError, ValueError):
        return False, None, None
    finally:
        conn.close()


def _say(line: str) -> None:
    """One line for whoever watches this process start (stderr, where gunicorn logs too)."""
    print(f"shinken-session-server: {line}", file=sys.stderr, flush=True)


def _not_ready(why: str) -> int:
    """The start-up failure: one line on stderr, the ``"ready": false`` line on stdout (for launchers)."""
    _say(f"error: {why}")
    print(json.dumps({"ready": False, "error": why}), flush=True)
    return EXIT_NOT_READY


def _check_engine(url: str, values: dict[str, Any], tokenizer: ChatTokenizer) -> str:
    """The engine at ``url`` checked as configured (see :mod:`webapp.engines.probe`); the kind to
    speak, said in one line. Raises ``EngineCheckFailed`` / ``EngineConfigError``."""
    identity = wait_for_engine(url, values["backend_wait"], _say)
    kind = resolve_kind(values["backend_kind"], identity, url)
    check_vocabulary(url, kind, tokenizer)
    dialect_for(kind, ReplayRequest(routed_experts=bool(values["routing_replay_layers"]),
                                    indexer_topk=bool(values["indexer_replay"])))
    found = identity.describe() if identity.kind is not None else "not identified (" + identity.describe() + ")"
    _say(f"backend {url}: {found}; speaking {kind}")
    return kind


def build_parser() -> argparse.ArgumentParser:
    """``--bind``, ``--api-key-file`` and one option per setting of :data:`webapp.settings.SETTINGS`."""
    parser = Parser(prog="shinken-session-server",
                    description="Run the Shinken session server (router + session workers) under gunicorn. "
                                "Every setting is also read from its SHINKEN_<NAME> variable; a flag wins.",
                    version=True)
    parser.add_argument("--bind", default="127.0.0.1:8000", type=parse_bind,
                        help="HOST:PORT to listen on; port 0 picks a free one (default: 127.0.0.1:8000)")
    parser.add_argument("--api-key-file", default=None, type=Path,
                        help="require 'Authorization: Bearer KEY' on all routes but /health, KEY being "
                             "this file's content (owner-only permissions; router mode only). "
                             "Or set $SHINKEN_API_KEY (default: no key)")
    add_arguments(parser)
    return parser


class ApiKeyFileError(WebappError, ValueError):
    """The ``--api-key-file`` cannot be used: unreadable, empty, or readable by others."""


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from ``--api-key-file``, ``--api-key`` (with a warning: anyone can read it in
    ``ps``, so the flag is scrubbed from this process's title) or ``$SHINKEN_API_KEY``."""
    if args.api_key_file is not None and args.api_key is not None:
        raise ApiKeyFileError("give --api-key-file or --api-key, not both")
    if args.api_key_file is not None:
        try:
            mode = args.api_key_file.stat().st_mode
            key: str = args.api_key_file.read_text(encoding="utf-8").strip()  # a Path (Namespace is Any)
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeyFileError(f"--api-key-file: cannot read {args.api_key_file}: {exc}") from None
        if mode & 0o077:
            raise ApiKeyFileError(f"--api-key-file: {args.api_key_file} is readable by other users "
                                  f"(mode {mode & 0o777:o}); chmod 600 it")
        if not key:
            raise ApiKeyFileError(f"--api-key-file: {args.api_key_file} is empty")
        return key
    if args.api_key is not None:
        flag_key: str = args.api_key  # argparse's Namespace is Any; the flag is a str
        print("warning: --api-key shows the key to every user of this machine (ps); "
              "use --api-key-file or SHINKEN_API_KEY", file=sys.stderr, flush=True)
        _scrub_title(flag_key)
        return flag_key or None
    return os.environ.get(API_KEY_ENV) or None


def _scrub_title(secret: str) -> None:
    # Rewrites /proc/self/cmdline, which ps reads; the key was visible only until now.
    import setproctitle

    setproctitle.setproctitle(" ".join(arg.replace(secret, "***") for arg in sys.orig_argv))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["nginx-config"]:
        from webapp import scaleout

        return scaleout.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    host, port = args.bind
    try:
        given = given_values(args)
        api_key = _api_key(args)
    except (ApiKeyFileError, ValueError) as exc:
        parser.error(str(exc))
    values = {**defaults(), **given}
    workers = values["workers"]
    if values["backend_url"] is not None:  # checked at once, before anything starts
        try:
            values["backend_url"] = check_backend_url(values["backend_url"])
        except BackendURLError as exc:
            parser.error(str(exc))
    elif values["backend_kind"] == "vllm":
        parser.error("--backend-kind vllm needs --backend-url: the embedded reference backend speaks sglang")
    try:  # imported once here: a bad selector is one line, not a worker that cannot boot
        SampleHooks.resolve(values["session_sample_picker_path"], values["session_sample_postprocessor_path"])
    except SampleHookSelectorError as exc:
        parser.error(str(exc))
    try:  # likewise the message matcher: an unknown one refuses start-up in both modes
        resolve_matcher(values["session_message_matcher"])
    except UnknownMatcher as exc:
        parser.error(f"--session-message-matcher: {type(exc).__name__}: {exc}")
    # Loaded once here, so a bad one is one line (not a traceback per worker and backend).
    try:
        tokenizer = load_tokenizer(values["tokenizer"])
    except (TokenizerLoadError, OSError, ValueError) as exc:
        parser.error(f"--tokenizer {values['tokenizer']}: {exc}")
    # Bound before anything starts: a taken port is a one-line usage error, not a traceback
    # after the backend is already up.
    ephemeral = port == 0
    try:
        listener = _listen(host, port)
    except OSError as exc:
        parser.error(f"cannot listen on {host}:{port}: {exc.strerror}; pass --bind with a free port (or port 0)")
    port = listener.getsockname()[1]
    scratch = None  # a data directory of this run only, removed at exit
    if values["data_dir"] is None and ephemeral:
        # No address to find the sessions again by: one per run would pile up under the state
        # directory, so the journals live in a private temporary directory for this run.
        scratch = values["data_dir"] = tempfile.mkdtemp(prefix="shinken-session-server-")
    elif values["data_dir"] is None:  # one per address: a restart on it finds its sessions again
        values["data_dir"] = default_data_dir(f"{host}-{port}")
    try:
        check_free(values["data_dir"])
    except (DataDirInUse, DataDirUnsafe, OSError) as exc:
        parser.error(str(exc))
    backend = None
    backend_url = values["backend_url"]
    if backend_url is not None:
        try:
            values["backend_kind"] = _check_engine(backend_url, values, tokenizer)
        except (EngineCheckFailed, EngineConfigError) as exc:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            return _not_ready(str(exc))
    else:
        values["backend_kind"] = "sglang"  # the reference backend's dialect
    if backend_url is None:
        from webapp.reference_backend import start_reference_backend

        def start_backend(bind: str | None) -> ReferenceBackendProcess:
            # R3 on by default, so the embedded setup exercises the routed-expert path end to end.
            where: dict[str, Any] = {"bind": bind} if bind else {}
            return start_reference_backend(tokenizer=values["tokenizer"], r3_layers=values["reference_r3_layers"],
                                           r3_topk=values["reference_r3_topk"], **where)

        # Restarted on the same address whenever it dies: the workers keep its URL.
        backend = SupervisedBackend(start_backend)
        backend_url = backend.url
        values["routing_replay_layers"] = embedded_replay_layers(given)
    values["backend_url"], values["api_key"] = backend_url, api_key
    env = launcher_env(values)
    app_uri = "webapp.router:create_app()" if workers else "webapp.app:create_app()"
    argv_gunicorn = [sys.executable, "-m", "gunicorn", "-c", str(CONF_PATH), "--bind", f"fd://{listener.fileno()}",
                     *gunicorn_version_flags(), "--worker-class", "webapp.gunicorn_worker.SessionServerWorker",
                     "--workers", "1", app_uri]
    # gunicorn dies with this process however it dies (SIGTERM: a graceful stop of its worker, which
    # stops the session workers); this process is single-threaded here, see shinken_sync.lifetime.
    # Its own session: a terminal's Ctrl-C reaches only this process, which forwards a graceful
    # SIGTERM (gunicorn's own SIGINT is a quick exit, whose gevent worker prints a traceback).
    gunicorn = subprocess.Popen(argv_gunicorn, env=env, pass_fds=[listener.fileno()], stdin=subprocess.DEVNULL,
                                start_new_session=True,
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
        started = time.monotonic()
        deadline, said = started + READY_TIMEOUT, False
        while not (health := _health(host, port))[0]:
            if gunicorn.poll() is not None or time.monotonic() > deadline or health[1] is not None:
                # a shard whose workers could not boot is never restarted: say why now, not at the deadline
                why = health[1] or (f"/health did not answer 200 in {READY_TIMEOUT:.0f} s" if gunicorn.poll() is None
                                    else f"gunicorn exited with code {gunicorn.returncode}")
                _terminate(gunicorn, 30.0)
                return _not_ready(why if health[2] is None else f"{why}: {health[2]}")
            if not said and health[2] is not None and time.monotonic() - started > _SAY_AFTER:
                _say(f"waiting up to {READY_TIMEOUT:.0f} s for /health to answer 200: {health[2]}")
                said = True
            time.sleep(_POLL)
        url_host = f"[{host}]" if ":" in host else host
        print(json.dumps({"ready": True, "url": f"http://{url_host}:{port}", "workers": workers,
                          "backend_url": backend_url, "backend_kind": values["backend_kind"],
                          "images": DIALECTS[values["backend_kind"]].takes_images,
                          "pid": os.getpid(), "instance": values["instance"],
                          "data_dir": values["data_dir"], "data_dir_removed_at_exit": scratch is not None}),
              flush=True)
        return gunicorn.wait()
    finally:
        _terminate(gunicorn, 30.0)
        if backend is not None:
            backend.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
