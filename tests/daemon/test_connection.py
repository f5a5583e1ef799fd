"""Handshake auth, ordering, malformed and oversized input, shutdown."""

from __future__ import annotations

import http.client
import json
import signal
import urllib.parse

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from shinken_sync import protocol

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("token", [None, "wrong-token", ""])
def test_wrong_or_missing_token_is_refused_with_401(vdaemon, aci, token):
    with pytest.raises(InvalidStatus) as info:
        aci(vdaemon.url, token)
    assert info.value.response.status_code == 401
    assert info.value.response.headers.get("WWW-Authenticate") == "Bearer"


def test_401_comes_before_the_upgrade_even_on_a_plain_get(vdaemon):
    url = urllib.parse.urlsplit(vdaemon.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("GET", url.path, headers={"Authorization": "Bearer nope"})
    assert conn.getresponse().status == 401
    conn.close()


def test_unknown_sandbox_path_is_404_for_an_authorised_client(vdaemon, aci):
    base = vdaemon.url.rsplit("/sb/", 1)[0]
    for path in ("/sb/1", "/", "/sb/x"):
        with pytest.raises(InvalidStatus) as info:
            aci(base + path, vdaemon.token)
        assert info.value.response.status_code == 404


def test_pipelined_calls_are_answered_in_order(vdaemon, aci):
    client = aci(vdaemon.url, vdaemon.token)
    plan = [("wait", {"ms": 150}), ("screen_size", {}), ("exec", {"cmd": "sleep 0.1; echo x"}),
            ("bogus_verb", {}), ("cursor", {}), ("screenshot", {"max_long_edge": 320}),
            ("wait", {"ms": 0}), ("click", {"x": -5, "y": 0}), ("move", {"x": 3, "y": 4})] * 5  # fmt: skip
    sent = [client.send(verb, **args) for verb, args in plan]
    replies = [client.recv_reply() for _ in sent]
    assert [r.call_id for r in replies] == sent
    outcomes = [(verb, r.outcome, r.error.kind if r.error else None) for (verb, _), r in zip(plan, replies)]
    assert outcomes[:9] == [
        ("wait", "ok", None), ("screen_size", "ok", None), ("exec", "ok", None),
        ("bogus_verb", "error", protocol.ERR_UNKNOWN_VERB), ("cursor", "ok", None),
        ("screenshot", "ok", None), ("wait", "ok", None), ("click", "error", protocol.ERR_BAD_ARGS),
        ("move", "ok", None),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("message", "call_id", "kind"),
    [
        ("{not json", None, protocol.ERR_BAD_REQUEST),
        ("[1, 2]", None, protocol.ERR_BAD_REQUEST),
        ('{"type": "call", "verb": "cursor"}', None, protocol.ERR_BAD_REQUEST),
        ('{"type": "call", "call_id": 7}', 7, protocol.ERR_BAD_REQUEST),
        ('{"type": "call", "call_id": "a", "verb": "nope"}', "a", protocol.ERR_UNKNOWN_VERB),
        ('{"type": "call", "call_id": 8, "verb": "cursor", "args": []}', 8, protocol.ERR_BAD_ARGS),
        ('{"type": "hello", "call_id": 9}', 9, protocol.ERR_BAD_REQUEST),
        (b"\x00\x01binary", None, protocol.ERR_BAD_REQUEST),
    ],
)
def test_malformed_messages_get_an_error_reply_and_the_connection_lives(vdaemon, aci, message, call_id, kind):
    client = aci(vdaemon.url, vdaemon.token)
    client.ws.send(message)
    reply = client.recv_reply()
    assert (reply.call_id, reply.outcome, reply.error.kind) == (call_id, protocol.ERROR, kind)
    assert client.ok("screen_size")["width"] > 0


def test_oversized_message_closes_only_that_connection_with_1009(vdaemon, aci):
    bystander = aci(vdaemon.url, vdaemon.token)
    victim = aci(vdaemon.url, vdaemon.token)
    huge = json.dumps({"type": "call", "call_id": 1, "verb": "type", "args": {"text": "a" * protocol.MAX_MESSAGE_SIZE}})
    try:
        victim.ws.send(huge)
    except ConnectionClosed:
        pass  # the daemon may close before the client finished writing
    with pytest.raises(ConnectionClosed) as info:
        victim.recv(timeout=20)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009
    assert bystander.ok("screen_size")["width"] > 0
    assert aci(vdaemon.url, vdaemon.token).ok("cursor")  # and it keeps accepting


def test_a_message_just_under_the_limit_is_accepted(vdaemon, aci):
    client = aci(vdaemon.url, vdaemon.token)
    text = "b" * 65_000  # within MAX_TYPE_CHARS; the message itself is the point
    reply = client.call("type", text=text[:65_536])
    assert reply.outcome == protocol.OK
    overhead = len(protocol.encode_call(1, "write_file", {"path": "/dev/null", "data": ""}))
    data = "A" * ((protocol.MAX_MESSAGE_SIZE - overhead - 16) // 4 * 4)
    reply = client.call("write_file", path="/dev/null", data=data)
    # 12 MiB of base64 is over the 8 MiB file cap: refused as bad_args, not a closed connection
    assert reply.outcome == protocol.ERROR and reply.error.kind == protocol.ERR_BAD_ARGS


def test_several_connections_share_one_sandbox(vdaemon, aci):
    a, b = aci(vdaemon.url, vdaemon.token), aci(vdaemon.url, vdaemon.token)
    a.ok("move", x=77, y=88)
    assert b.ok("cursor") == {"x": 77, "y": 88}


def test_sigterm_shuts_down_cleanly(shinkend, aci):
    daemon = shinkend()
    client = aci(daemon.url, daemon.token)
    client.ok("cursor")
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(15) == 0
    with pytest.raises(ConnectionClosed) as info:
        client.recv(timeout=5)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1001
    assert "Traceback" not in daemon.stderr()


def _token_file(directory, token: str = "a-good-token-of-32-characters-ok", mode: int = 0o600):
    path = directory / "t.token"
    path.write_text(token)
    path.chmod(mode)
    return path


def test_bad_command_line_and_token_file_exit_with_2(tmp_path):
    import subprocess
    import sys

    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    for args in (["--token-file", str(empty)], ["--token-file", str(tmp_path / "missing")],
                 ["--token-file", str(empty), "--screen", "huge"],
                 ["--token-file", str(empty), "--fleet", "2", "--display", "xvfb"]):  # fmt: skip
        proc = subprocess.run([sys.executable, "-m", "shinken_sync.daemon.server", *args],
                              capture_output=True, timeout=30, check=False)  # fmt: skip
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stdout == b""


def test_a_repeated_authorization_header_is_refused(vdaemon):
    url = urllib.parse.urlsplit(vdaemon.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.putrequest("GET", url.path)
    for value in (f"Bearer {vdaemon.token}", "Bearer other"):
        conn.putheader("Authorization", value)
    for name, value in (("Upgrade", "websocket"), ("Connection", "Upgrade"), ("Sec-WebSocket-Version", "13"),
                        ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")):  # fmt: skip
        conn.putheader(name, value)
    conn.endheaders()
    assert conn.getresponse().status == 401
    conn.close()


def test_a_display_that_cannot_start_exits_with_3(tmp_path):
    import subprocess
    import sys

    token = _token_file(tmp_path)
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}  # no Xvfb on this PATH
    proc = subprocess.run([sys.executable, "-m", "shinken_sync.daemon.server", "--token-file", str(token),
                           "--display", "xvfb", "--screen", "640x480"],
                          capture_output=True, timeout=30, check=False, env=env)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == b"" and b"Xvfb" in proc.stderr


def test_a_port_in_use_exits_with_3(vdaemon, tmp_path):
    import subprocess
    import sys

    token = _token_file(tmp_path)
    port = str(urllib.parse.urlsplit(vdaemon.url).port)
    proc = subprocess.run([sys.executable, "-m", "shinken_sync.daemon.server", "--token-file", str(token),
                           "--port", port, "--screen", "1024x768"],
                          capture_output=True, timeout=30, check=False)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == b"" and b"cannot listen" in proc.stderr
