"""Fixtures shared by the whole suite: real shinkend daemons and a raw ACI client.

* ``shinkend`` (function scope) / ``module_shinkend`` (module scope): a factory
  ``shinkend(display="virtual", screen=(1280, 800), rtt_ms=0, fleet=0, args=())``
  that starts a real daemon process and returns a :class:`Shinkend` -- unpack it
  as ``url, token, proc = shinkend()``; ``.ready`` is the parsed ready line and
  ``.urls`` every sandbox URL. Every daemon is stopped at teardown.
* ``vdaemon``: one virtual-display daemon shared by a test module.
* ``fleet_host``: one ``--fleet 4`` daemon shared by a test module.
* ``aci``: ``aci(url, token)`` opens a raw protocol connection (:class:`AciClient`)
  for tests that speak the wire protocol without the SDK; closed at teardown.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect

from shinken_sync import protocol
from shinken_sync.childproc import ReadyLineError, read_ready_line

START_TIMEOUT_S = 30.0
DEFAULT_SCREEN = (1280, 800)


class Shinkend:
    """A running shinkend process; iterates as ``(url, token, proc)``."""

    def __init__(self, proc: subprocess.Popen, token: str, ready: dict[str, Any], stderr_path: Path):
        self.proc = proc
        self.token = token
        self.ready = ready
        self.url: str = ready["url"]
        self.urls: list[str] = ready.get("urls", [self.url])
        self.stderr_path = stderr_path

    def __iter__(self) -> Iterator[Any]:
        return iter((self.url, self.token, self.proc))

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode


class ShinkendFactory:
    def __init__(self, workdir: Path):
        self._workdir = workdir
        self._running: list[Shinkend] = []

    def __call__(
        self,
        *,
        display: str = "virtual",
        screen: tuple[int, int] = DEFAULT_SCREEN,
        rtt_ms: float = 0,
        fleet: int = 0,
        args: tuple[str, ...] | list[str] = (),
        token: str | None = None,
    ) -> Shinkend:
        token = token or secrets.token_urlsafe(16)
        n = len(self._running)
        token_path = self._workdir / f"shinkend-{n}.token"
        token_path.write_text(token)
        token_path.chmod(0o600)
        stderr_path = self._workdir / f"shinkend-{n}.stderr"
        cmd = [
            sys.executable, "-m", "shinken_sync.daemon.server",
            "--token-file", str(token_path), "--display", display,
            "--screen", f"{screen[0]}x{screen[1]}", "--rtt-ms", str(rtt_ms), *args,
        ]  # fmt: skip
        if fleet:
            cmd += ["--fleet", str(fleet)]
        with open(stderr_path, "wb") as stderr:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL)
        line = _read_line(proc, START_TIMEOUT_S)
        if not line:
            proc.kill()
            proc.wait()
            pytest.fail(f"shinkend did not start:\n{stderr_path.read_text(errors='replace')[-3000:]}")
        daemon = Shinkend(proc, token, json.loads(line), stderr_path)
        self._running.append(daemon)
        return daemon

    def close(self) -> None:
        for daemon in self._running:
            daemon.stop()
            if daemon.proc.stdout:
                daemon.proc.stdout.close()


def _read_line(proc: subprocess.Popen, timeout: float) -> bytes:
    try:
        return read_ready_line(proc.stdout.fileno(), timeout)
    except ReadyLineError:
        return b""


@pytest.fixture(scope="session", autouse=True)
def _state_home_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every session server's default data directory ($XDG_STATE_HOME/shinken/...) in a
    temporary directory: servers and apps that module fixtures start before any test runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
        yield


@pytest.fixture(autouse=True)
def _state_home(_state_home_session: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """... and one per test, so an app built without a data dir sees no earlier test's sessions."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


@pytest.fixture
def shinkend(tmp_path: Path) -> Iterator[ShinkendFactory]:
    factory = ShinkendFactory(tmp_path)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def module_shinkend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShinkendFactory]:
    factory = ShinkendFactory(tmp_path_factory.mktemp("shinkend"))
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def vdaemon(module_shinkend: ShinkendFactory) -> Shinkend:
    return module_shinkend()


@pytest.fixture(scope="module")
def fleet_host(module_shinkend: ShinkendFactory) -> Shinkend:
    return module_shinkend(fleet=4)


# ---------------------------------------------------------------------------
# A raw protocol client (websockets' sync client; no SDK involved)


class AciClient:
    """Speaks the ACI wire protocol directly. ``hello`` is the first message."""

    def __init__(self, url: str, token: str | None, timeout: float = 20.0):
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        # Entered as a context manager: websockets 17 deprecates the bare call.
        self._stack = contextlib.ExitStack()
        self.ws: ClientConnection = self._stack.enter_context(
            connect(url, additional_headers=headers, compression=None, max_size=protocol.MAX_MESSAGE_SIZE,
                    open_timeout=timeout)
        )  # fmt: skip
        self.timeout = timeout
        self._next_id = 0
        self.hello = self.recv()
        assert isinstance(self.hello, protocol.Hello), self.hello

    def send(self, verb: str, **args: Any) -> int:
        self._next_id += 1
        self.ws.send(protocol.encode_call(self._next_id, verb, args))
        return self._next_id

    def recv(self, timeout: float | None = None) -> protocol.ServerMessage:
        return protocol.decode_server_message(self.ws.recv(timeout if timeout is not None else self.timeout))

    def recv_reply(self, timeout: float | None = None) -> protocol.Reply:
        """The next reply, skipping frames and stream_end messages."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            if isinstance(msg, protocol.Reply):
                return msg

    def call(self, verb: str, **args: Any) -> protocol.Reply:
        call_id = self.send(verb, **args)
        reply = self.recv_reply()
        assert reply.call_id == call_id, (reply, call_id)
        return reply

    def ok(self, verb: str, **args: Any) -> dict[str, Any]:
        """Call and insist on outcome ok; returns the result."""
        reply = self.call(verb, **args)
        assert reply.outcome == protocol.OK, reply
        return reply.result or {}

    def close(self) -> None:
        self._stack.close()


@pytest.fixture
def aci() -> Iterator[Any]:
    clients: list[AciClient] = []

    def open_client(url: str, token: str | None, timeout: float = 20.0) -> AciClient:
        client = AciClient(url, token, timeout)
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        client.close()

