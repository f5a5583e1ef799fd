"""The daemon under hostile input and faults: they cost nothing.

Each test names the behaviour it pins. The codec tests run in-process; the
rest against a real shinkend on loopback. File verbs only touch ``tmp_path``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.parse

import pytest
from websockets.exceptions import InvalidStatus

from bench import procfs
from shinken_sync import protocol
from shinken_sync.childproc import parse_ready_line, read_ready_line
from shinken_sync.daemon import args as daemon_args
from shinken_sync.daemon.errors import BadArgs
from tests.fuzz.rawws import OP_TEXT, RawWs, frame

SCREEN = daemon_args.Screen(1280, 800)


# ---------------------------------------------------------------------------
# The codec (both peers decode with it)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"])
def test_non_finite_numbers_are_refused_at_decode(literal):
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode_call(f'{{"call_id": 4, "verb": "screencast_start", "args": {{"fps": {literal}}}}}')
    assert (info.value.kind, info.value.call_id) == (protocol.ERR_BAD_ARGS, 4)
    assert "fps" in str(info.value)
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_server_message(f'{{"type": "reply", "call_id": 1, "outcome": "ok", "result": {{"v": {literal}}}}}')
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_call(f"[{literal}]")


def test_finite_floats_still_decode():
    call = protocol.decode_call('{"call_id": 1, "verb": "screencast_start", "args": {"fps": 2.5e-1}}')
    assert call.args == {"fps": 0.25}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_the_number_checker_refuses_non_finite_values(value):  # in-process callers
    with pytest.raises(BadArgs, match="finite"):
        daemon_args.validate("screencast_start", {"fps": value}, SCREEN)
    with pytest.raises(BadArgs):
        daemon_args.validate("wait", {"ms": value}, SCREEN)


def test_deep_nesting_is_a_bad_request_not_a_crash():
    with pytest.raises(protocol.ProtocolError) as info:
        # Deeper than any CPython's decoder goes (3.11 stops near 1,000, later ones further).
        protocol.decode_call('{"call_id": 1, "verb": "cursor", "args": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}")
    assert info.value.kind == protocol.ERR_BAD_REQUEST and "deep" in str(info.value)


def test_a_call_id_with_a_lone_surrogate_is_refused_unaddressed():
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode_call('{"call_id": "a\\ud800", "verb": "cursor"}')
    assert (info.value.kind, info.value.call_id) == (protocol.ERR_BAD_REQUEST, None)
    assert "\ud800" not in str(info.value)


@pytest.mark.parametrize(
    ("verb", "args"),
    [
        ("screenshot", {"format": []}),  # unhashable: was a TypeError -> internal
        ("screenshot", {"format": {"a": 1}}),
        ("screencast_start", {"format": 7}),
        ("read_file", {"path": "/tmp/\ud800"}),
        ("read_file", {"path": "/tmp/a-\udcff"}),
        ("write_file", {"path": "x\ud800", "data": ""}),
        ("exec", {"cmd": "echo \ud800"}),
        ("exec", {"cmd": "echo a\x00b"}),  # was a ValueError from the subprocess -> internal
        ("exec", {"cmd": "true", "env": {"K": "\ud800"}}),
        ("type", {"text": "\udc80"}),
        ("screencast_stop", {"stream_id": "\ud800"}),
    ],
)
def test_wrong_types_and_surrogates_are_bad_args(verb, args):
    with pytest.raises(BadArgs):
        daemon_args.validate(verb, args, SCREEN)


def test_errors_quote_at_most_a_bounded_piece_of_the_input():
    huge = "\x01" * 2**20
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode_call(json.dumps({"call_id": 1, "verb": huge}))
    assert len(str(info.value)) < 1000
    with pytest.raises(BadArgs) as bad:
        daemon_args.validate("cursor", {huge + str(i): 1 for i in range(50)}, SCREEN)
    assert len(str(bad.value)) < 1000
    with pytest.raises(BadArgs) as bad:
        daemon_args.validate("screenshot", {"format": huge}, SCREEN)
    assert len(str(bad.value)) < 1000


# ---------------------------------------------------------------------------
# Against a real daemon


@pytest.fixture
def client(vdaemon, aci):
    return aci(vdaemon.url, vdaemon.token)


def _stderr_since(daemon, offset: int) -> str:
    return daemon.stderr()[offset:]


@pytest.mark.integration
def test_nan_fps_over_the_wire_is_bad_args_and_the_connection_lives(client):
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        client.ws.send(f'{{"type":"call","call_id":"nan","verb":"screencast_start","args":{{"fps":{literal}}}}}')
        reply = client.recv_reply()
        assert (reply.call_id, reply.outcome, reply.error.kind) == ("nan", protocol.ERROR, protocol.ERR_BAD_ARGS)
    client.ws.send('{"type":"call","call_id":"p","verb":"resume_screencast","args":{"stream_id":"s","params":{"fps":NaN}}}')
    assert client.recv_reply().error.kind == protocol.ERR_BAD_ARGS
    assert client.ok("screen_size")["width"] == 1280


@pytest.mark.integration
def test_deep_nesting_gets_bad_request_and_keeps_queued_calls(client):
    ids = [client.send("wait", ms=100)]
    client.ws.send('{"call_id": 1, "verb": "cursor", "args": {"x": ' + "[" * 1000 + "]" * 1000 + "}}")
    ids += [client.send("screen_size"), client.send("cursor")]
    first = client.recv_reply()
    deep = client.recv_reply()
    rest = [client.recv_reply(), client.recv_reply()]
    assert first.call_id == ids[0] and first.outcome == protocol.OK
    # 3.11's decoder gives up near 1,000 levels (bad_request); one that parses it
    # finds "x" is no argument of cursor. Either way: a reply, not a 1011 close.
    assert (deep.call_id, deep.error.kind) in ((None, protocol.ERR_BAD_REQUEST), (1, protocol.ERR_BAD_ARGS))
    assert [r.call_id for r in rest] == ids[1:] and all(r.outcome == protocol.OK for r in rest)


@pytest.mark.integration
def test_a_surrogate_call_id_gets_an_encodable_reply(vdaemon):
    raw = RawWs(vdaemon.url, vdaemon.token)
    try:
        assert isinstance(raw.recv(), str)  # hello
        raw.send_text('{"type":"call","call_id":"\\ud800","verb":"cursor"}')
        reply = protocol.decode_server_message(raw.recv())
        assert (reply.call_id, reply.error.kind) == (None, protocol.ERR_BAD_REQUEST)
        raw.send_text('{"type":"call","call_id":2,"verb":"screen_size"}')
        assert protocol.decode_server_message(raw.recv()).outcome == protocol.OK
    finally:
        raw.close()


@pytest.mark.integration
def test_bad_types_and_surrogate_paths_are_bad_args_without_a_traceback(vdaemon, client, tmp_path):
    offset = len(vdaemon.stderr())
    cases = [
        '{"call_id":1,"verb":"screenshot","args":{"format":[]}}',
        '{"call_id":2,"verb":"screenshot","args":{"format":{"x":1}}}',
        f'{{"call_id":3,"verb":"read_file","args":{{"path":"{tmp_path}/\\ud800"}}}}',
        f'{{"call_id":4,"verb":"write_file","args":{{"path":"{tmp_path}/\\udcff","data":""}}}}',
        f'{{"call_id":5,"verb":"exec","args":{{"cmd":"true","cwd":"{tmp_path}/\\ud800"}}}}',
        '{"call_id":6,"verb":"exec","args":{"cmd":"echo a\\u0000b"}}',
    ]
    for text in cases:
        client.ws.send(text)
        reply = client.recv_reply()
        assert (reply.outcome, reply.error.kind) == (protocol.ERROR, protocol.ERR_BAD_ARGS), (text, reply)
    assert list(tmp_path.iterdir()) == []
    assert client.ok("cursor")
    assert "Traceback" not in _stderr_since(vdaemon, offset)


@pytest.mark.integration
def test_a_huge_sandbox_index_is_404_not_500(vdaemon, aci):
    base = vdaemon.url.rsplit("/sb/", 1)[0]
    offset = len(vdaemon.stderr())
    for path in ("/sb/" + "9" * 4301, "/sb/" + "1" * 8000, "/sb/99999"):
        with pytest.raises(InvalidStatus) as info:
            aci(base + path, vdaemon.token)
        assert info.value.response.status_code == 404
        assert len(info.value.response.body) < 300
    assert "Traceback" not in _stderr_since(vdaemon, offset)


@pytest.mark.integration
def test_binary_exec_output_stays_under_the_message_limit(client):
    cap = daemon_args.MAX_EXEC_OUTPUT
    reply = client.call("exec", cmd=f"head -c {cap} /dev/zero; head -c {cap} /dev/zero >&2", max_output=cap)
    assert reply.outcome == protocol.OK, reply  # the client enforces MAX_MESSAGE_SIZE: it got here
    result = reply.result
    assert result["stdout_truncated"] and result["stderr_truncated"]
    assert 0 < len(result["stdout"]) < cap and set(result["stdout"]) == {"\x00"}
    encoded = protocol.encode_reply(1, result=result).encode()
    assert len(encoded) <= protocol.MAX_MESSAGE_SIZE
    # Plain text below the cap is untouched.
    small = client.ok("exec", cmd="printf 'a\\000b'")
    assert small["stdout"] == "a\x00b" and not small["stdout_truncated"]


@pytest.mark.integration
def test_errors_never_echo_unbounded_input(client):
    client.ws.send(json.dumps({"type": "call", "call_id": 1, "verb": "\x01" * 2**20}))
    raw = client.ws.recv(20)
    assert len(raw) < 2000 and json.loads(raw)["error"]["kind"] == protocol.ERR_UNKNOWN_VERB
    client.ws.send(json.dumps({"type": "call", "call_id": 2, "verb": "key", "args": {"x" * 2**20: 1}}))
    raw = client.ws.recv(20)
    assert len(raw) < 2000 and json.loads(raw)["error"]["kind"] == protocol.ERR_BAD_ARGS
    client.ws.send(json.dumps({"type": "\x02" * 2**20, "call_id": 3}))
    raw = client.ws.recv(20)
    assert len(raw) < 2000 and json.loads(raw)["error"]["kind"] == protocol.ERR_BAD_REQUEST


@pytest.mark.integration
def test_file_verbs_refuse_a_fifo_and_screenshots_keep_working(vdaemon, aci, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    clients = [aci(vdaemon.url, vdaemon.token) for _ in range(8)]
    for c in clients:
        c.send("read_file", path=str(fifo))
    for c in clients:
        reply = c.recv_reply(timeout=20)
        assert (reply.outcome, reply.error.kind) == (protocol.ERROR, protocol.ERR_FAILED)
        assert "regular file" in reply.error.message
    reply = clients[0].call("write_file", path=str(fifo), data="eA==")
    assert (reply.outcome, reply.error.kind) == (protocol.ERROR, protocol.ERR_FAILED)
    reply = clients[0].call("read_file", path="/dev/zero", max_bytes=10)
    assert reply.error is not None and "regular file" in reply.error.message
    assert clients[0].call("screenshot", max_long_edge=200).outcome == protocol.OK
    assert fifo.is_fifo()  # never replaced or truncated


def _ran(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _flood(daemon, marker, count: int, step: str = "sleep 0.2") -> RawWs:
    """A raw connection with ``count`` pipelined execs, each appending a line to ``marker``."""
    raw = RawWs(daemon.url, daemon.token)
    assert isinstance(raw.recv(), str)  # hello
    cmd = f"{step}; echo x >> {marker}"
    calls = (json.dumps({"type": "call", "call_id": i, "verb": "exec", "args": {"cmd": cmd}}) for i in range(count))
    raw.sock.sendall(b"".join(frame(OP_TEXT, call.encode()) for call in calls))
    return raw


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.integration
@pytest.mark.parametrize("ending", ["reset", "fin"])
def test_queued_calls_do_not_run_after_the_client_left(vdaemon, tmp_path, ending):
    marker = tmp_path / "ran"
    raw = _flood(vdaemon, marker, 300)
    assert _wait_for(lambda: _ran(marker) >= 1)
    raw.reset() if ending == "reset" else raw.close()
    time.sleep(3)
    ran = _ran(marker)
    time.sleep(2)
    # The call running when the client left may finish (or be killed); the
    # ~100 queued and buffered behind it must not run: 2 s would run 10 of them.
    assert _ran(marker) == ran and ran <= 20, ran


@pytest.mark.integration
def test_exec_children_of_a_reset_connection_are_killed(vdaemon, tmp_path):
    pid_file = tmp_path / "pid"
    raw = RawWs(vdaemon.url, vdaemon.token)
    assert isinstance(raw.recv(), str)
    raw.send_text(json.dumps({"call_id": 0, "verb": "exec", "args": {"cmd": f"sleep 60 & echo $! > {pid_file}; wait"}}))
    # Enough behind it to fill the queue: the daemon stops reading this socket.
    calls = (json.dumps({"call_id": i, "verb": "cursor"}).encode() for i in range(1, 200))
    raw.sock.sendall(b"".join(frame(OP_TEXT, call) for call in calls))
    assert _wait_for(lambda: pid_file.exists() and pid_file.read_text().strip())
    pid = int(pid_file.read_text())
    raw.reset()
    assert _wait_for(lambda: not procfs.alive(pid), timeout=10), "the reset connection's exec child is still alive"


def test_a_cancel_while_the_command_starts_kills_its_whole_group(tmp_path, monkeypatch):
    """The command may run before ``exec`` holds its process handle (the child starts, then the
    loop connects its pipes). A cancel then (the client reset on a loaded daemon) used to leave
    the shell's children alive: asyncio kills only the shell it started, not its group."""
    import asyncio

    from shinken_sync.daemon.shell import Shell

    real_start = asyncio.create_subprocess_exec
    pid_file = tmp_path / "pid"

    async def slow_start(*args, **kwargs):  # a busy loop: the command runs before exec() gets it
        proc = await real_start(*args, **kwargs)
        await asyncio.sleep(2.0)
        return proc

    async def cancel_once_the_command_ran() -> None:
        cmd = f"sleep 60 & echo $! > {pid_file}; wait"
        params = daemon_args.validate("exec", {"cmd": cmd}, SCREEN)
        task = asyncio.ensure_future(Shell().exec(params))
        while not (pid_file.exists() and pid_file.read_text().strip()):
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", slow_start)
    asyncio.run(asyncio.wait_for(cancel_once_the_command_ran(), 30))
    pid = int(pid_file.read_text())
    assert _wait_for(lambda: not procfs.alive(pid), timeout=5), "the cancelled command's background child lives on"




@pytest.mark.integration
def test_sigterm_does_not_wait_for_queued_calls(shinkend, tmp_path):
    daemon = shinkend()
    marker = tmp_path / "ran"
    raw = _flood(daemon, marker, 300)
    assert _wait_for(lambda: _ran(marker) >= 1)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(30) == 0
    raw.close()
    assert "still open" not in daemon.stderr()
    assert _ran(marker) <= 20


# ---------------------------------------------------------------------------
# The token


def _start(tmp_path, token_file=None, env_token=None, timeout=30):
    env = {k: v for k, v in os.environ.items() if k != "SHINKEND_TOKEN"}
    if env_token is not None:
        env["SHINKEND_TOKEN"] = env_token
    cmd = [sys.executable, "-m", "shinken_sync.daemon.server", "--screen", "1024x768"]
    if token_file is not None:
        cmd += ["--token-file", str(token_file)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, stdin=subprocess.DEVNULL)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("token", "mode", "message"),
    [
        ("a-long-enough-token-0123456789", 0o644, b"group/others"),
        ("a-long-enough-token-0123456789", 0o640, b"group/others"),
        ("a-long-enough-token-0123456789", 0o602, b"group/others"),
        ("short-token", 0o600, b"shorter than 16 bytes"),
        ("\n\n", 0o600, b"empty"),
    ],
)
def test_an_unsafe_or_short_token_is_refused_with_exit_2(tmp_path, token, mode, message):
    path = tmp_path / "token"
    path.write_text(token)
    path.chmod(mode)
    proc = _start(tmp_path, token_file=path)
    try:
        out, err = proc.communicate(timeout=30)
    finally:  # a daemon that (wrongly) started must not outlive the test
        proc.kill()
        proc.wait()
    assert proc.returncode == 2 and out == b"", err
    assert message in err


@pytest.mark.integration
def test_a_token_from_the_environment_works_and_exec_never_sees_it(tmp_path, aci):
    token = "env-token-" + os.urandom(12).hex()
    proc = _start(tmp_path, env_token=token)
    try:
        ready = parse_ready_line(read_ready_line(proc.stdout.fileno(), 30)) or {}
        client = aci(ready["url"], token)
        result = client.ok("exec", cmd='printf "%s" "${SHINKEND_TOKEN-unset}"')
        assert result["stdout"] == "unset"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    # With a token file too, the variable is still scrubbed (and the file wins).
    path = tmp_path / "token"
    path.write_text("file-token-" + os.urandom(12).hex())
    path.chmod(0o600)
    proc = _start(tmp_path, token_file=path, env_token=token)
    try:
        ready = parse_ready_line(read_ready_line(proc.stdout.fileno(), 30)) or {}
        client = aci(ready["url"], path.read_text())
        assert client.ok("exec", cmd='printf "%s" "${SHINKEND_TOKEN-unset}"')["stdout"] == "unset"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    no_token = _start(tmp_path)
    try:
        _, err = no_token.communicate(timeout=30)
    finally:
        no_token.kill()
        no_token.wait()
    assert no_token.returncode == 2 and b"SHINKEND_TOKEN" in err


def test_the_url_path_limit_matches_the_fleet_limit():
    from shinken_sync.daemon import server

    assert server._PATH.fullmatch(server.sandbox_path(server.MAX_FLEET - 1))
    assert not server._PATH.fullmatch(server.sandbox_path(server.MAX_FLEET * 10))
    assert urllib.parse.quote("/sb/1") == "/sb/1"


@pytest.mark.integration
@pytest.mark.parametrize("grace", ["nan", "inf", "-1"])
def test_a_non_finite_stream_grace_is_a_usage_error(tmp_path, grace):  # the command line
    path = tmp_path / "token"
    path.write_text("a-long-enough-token-0123456789")
    path.chmod(0o600)
    proc = subprocess.run([sys.executable, "-m", "shinken_sync.daemon.server", "--token-file", str(path),
                           "--stream-grace", grace], capture_output=True, timeout=30, check=False)  # fmt: skip
    assert proc.returncode == 2 and b"--stream-grace" in proc.stderr


def test_a_reply_over_the_message_limit_becomes_an_error_reply():  # the backstop
    import asyncio

    from shinken_sync.daemon import verbs
    from shinken_sync.daemon.display.base import EncodedImage
    from shinken_sync.daemon.display.virtual import VirtualDisplay
    from shinken_sync.daemon.screencast import StreamRegistry

    async def main():
        display = VirtualDisplay(1024, 768)

        async def huge(**_):
            return EncodedImage(b"\x89PNG" + bytes(protocol.MAX_MESSAGE_SIZE), "png", 1024, 768, 1.0)

        display.screenshot = huge
        sandbox = verbs.SandboxState("t", display, StreamRegistry(display))
        return await verbs.execute(sandbox, None, protocol.Call(9, "screenshot", {"format": "png"}))

    reply = asyncio.run(main())
    assert isinstance(reply, str) and len(reply) < 1000
    decoded = protocol.decode_server_message(reply)
    assert (decoded.call_id, decoded.error.kind) == (9, protocol.ERR_FAILED)
    assert "message limit" in decoded.error.message


def test_an_unencodable_result_becomes_an_internal_error_reply():  # the backstop
    import asyncio

    from shinken_sync.daemon import verbs
    from shinken_sync.daemon.display.virtual import VirtualDisplay
    from shinken_sync.daemon.screencast import StreamRegistry

    async def main():
        display = VirtualDisplay(1024, 768)

        async def cursor():
            return ("\ud800", 0)  # as if a backend leaked an undecodable name

        display.cursor = cursor
        sandbox = verbs.SandboxState("t", display, StreamRegistry(display))
        return await verbs.execute(sandbox, None, protocol.Call(3, "cursor", {}))

    reply = asyncio.run(main())
    reply.encode()  # sendable
    decoded = protocol.decode_server_message(reply)
    assert (decoded.call_id, decoded.error.kind) == (3, protocol.ERR_INTERNAL)


def test_screenshots_do_not_share_threads_with_blocked_calls():
    import asyncio
    import threading

    from shinken_sync.daemon import verbs
    from shinken_sync.daemon.display.virtual import VirtualDisplay

    release = threading.Event()

    async def main():
        loop = asyncio.get_running_loop()
        # Every thread file calls or asyncio's default executor could lend is stuck.
        stuck = [loop.run_in_executor(None, release.wait) for _ in range(64)]
        files = getattr(verbs, "FILE_THREADS", None)  # (absent in older daemons: files used the default pool)
        stuck += [loop.run_in_executor(files, release.wait) for _ in range(16)]
        try:
            display = VirtualDisplay(1024, 768)
            await asyncio.wait_for(display.start(), 30)
            return await asyncio.wait_for(display.screenshot(format="png", max_long_edge=64), 30)
        finally:
            release.set()
            await asyncio.gather(*stuck)

    image = asyncio.run(main())
    assert image.format == "png" and image.width == 64
