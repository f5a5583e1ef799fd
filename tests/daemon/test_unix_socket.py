"""shinkend on a unix socket with its token from a pipe, dialed by both SDK faces.

The isolated provider runs every daemon this way (no address on any network, the
token in no file, argv or environment); these tests need no root.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shinken_sync import protocol, transport
from shinken_sync.client import aconnect
from shinken_sync.errors import AuthRefused
from shinken_sync.sync import connect

pytestmark = pytest.mark.integration


@pytest.fixture
def unix_daemon(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str, str]]:
    token = secrets.token_urlsafe(24)
    read_end, write_end = os.pipe()
    os.write(write_end, token.encode())
    os.close(write_end)
    sock = tmp_path / "s"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shinken_sync.daemon.server", "--token-fd", str(read_end), "--unix", str(sock),
         "--screen", "1024x768"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(read_end,),
    )  # fmt: skip
    os.close(read_end)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read().decode(errors="replace")[-3000:]
        ready = json.loads(line)
        yield proc, ready["url"], token
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_ready_url_names_the_socket_and_no_port_is_open(unix_daemon, tmp_path: Path) -> None:
    proc, url, _ = unix_daemon
    assert url == protocol.unix_url(str(tmp_path / "s"), "/sb/0")
    assert protocol.split_unix_url(url) == (str(tmp_path / "s"), "ws://localhost/sb/0")
    inodes = {os.readlink(f"/proc/{proc.pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{proc.pid}/fd")
              if os.readlink(f"/proc/{proc.pid}/fd/{fd}").startswith("socket:[")}  # fmt: skip
    tcp = Path("/proc/net/tcp").read_text() + Path("/proc/net/tcp6").read_text()
    assert not inodes & {line.split()[9] for line in tcp.splitlines()[1:]}


def test_the_token_is_in_no_argv_environment_or_file(unix_daemon) -> None:
    proc, _, token = unix_daemon
    assert token not in Path(f"/proc/{proc.pid}/cmdline").read_text()
    assert token not in Path(f"/proc/{proc.pid}/environ").read_bytes().decode(errors="replace")
    fds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
    assert not [fd for fd in fds if fd.startswith("pipe:")][2:]  # stdout, stderr; the token pipe is closed


def test_both_faces_dial_a_unix_socket(unix_daemon) -> None:
    _, url, token = unix_daemon
    with connect(url, token) as sb:
        assert sb.screen == (1024, 768)
        assert sb.exec("echo hi").stdout == "hi\n"

    async def main() -> None:
        sb = await aconnect(url, token)
        try:
            assert sb.transport == transport.WEBSOCKETS  # picows dials TCP only
            assert (await sb.screenshot()).data
        finally:
            await sb.close()
        with pytest.raises(AuthRefused):
            await aconnect(url, "wrong" * 5)

    asyncio.run(main())


def test_unix_urls_always_use_websockets() -> None:
    assert transport.choose(transport.FAST if transport.fast_available() else transport.AUTO, unix=True).name \
        == transport.WEBSOCKETS
    with pytest.raises(ValueError):
        protocol.split_unix_url("ws+unix:///sb/0")
    assert protocol.split_unix_url("ws://127.0.0.1:1/sb/0") is None


def test_exec_returns_when_the_command_exits_not_when_its_background_does(unix_daemon) -> None:
    # Python 3.11's Process.wait() also waited for every pipe to close: a background process
    # holding stdout kept the reply for its whole life, about half the time.
    _, url, token = unix_daemon
    with connect(url, token) as sb:
        for _ in range(4):
            t0 = time.monotonic()
            assert sb.exec("sleep 5 & echo started", timeout=10).stdout == "started\n"
            assert time.monotonic() - t0 < 2.5


def test_a_token_from_the_environment_leaves_no_trace_in_proc(tmp_path: Path) -> None:
    # /proc/PID/environ keeps a process's initial environment whatever os.environ becomes:
    # the daemon moves the token into a pipe and re-executes itself without the variable.
    token = "env-token-" + secrets.token_hex(12)
    env = {**{k: v for k, v in os.environ.items() if k != "SHINKEND_TOKEN"}, "SHINKEND_TOKEN": token}
    proc = subprocess.Popen([sys.executable, "-m", "shinken_sync.daemon.server", "--unix", str(tmp_path / "s")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)  # fmt: skip
    try:
        ready = json.loads(proc.stdout.readline())
        for name in ("environ", "cmdline"):
            assert token not in Path(f"/proc/{proc.pid}/{name}").read_bytes().decode(errors="replace")
        with connect(ready["url"], token) as sb:
            assert sb.exec('printf "%s" "${SHINKEND_TOKEN-unset}"').stdout == "unset"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("url", ["ws+unix:///sb/0", "ws+unix://relative%2Fs/sb/0", "ws+unix://"])
def test_a_malformed_unix_url_is_refused_before_any_dial(url: str) -> None:
    from shinken_sync.errors import InvalidURL

    with pytest.raises(InvalidURL):
        asyncio.run(aconnect(url, "t" * 16))
