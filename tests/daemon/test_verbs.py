"""Every verb of shinkend against a real daemon (virtual display)."""

from __future__ import annotations

import base64
import io
import os
import time

import pytest
from PIL import Image

from bench import procfs
from shinken_sync import protocol
from shinken_sync.daemon.display.virtual import WIDGETS

pytestmark = pytest.mark.integration

SCREEN = (1280, 800)


@pytest.fixture
def client(vdaemon, aci):
    return aci(vdaemon.url, vdaemon.token)


def _image(reply: protocol.Reply) -> Image.Image:
    assert reply.outcome == protocol.OK, reply
    assert reply.image is not None, "a screenshot reply is a binary message"
    img = Image.open(io.BytesIO(bytes(reply.image)))
    img.load()
    return img


def _center(widget: str) -> tuple[int, int]:
    x, y, w, h = WIDGETS[widget]
    return x + w // 2, y + h // 2


def test_hello_describes_the_sandbox(client):
    hello = client.hello
    assert hello.protocol == protocol.PROTOCOL_VERSION
    assert (hello.width, hello.height) == SCREEN
    assert set(hello.verbs) == protocol.VERBS
    assert hello.display == "virtual"
    assert hello.sandbox_id


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_screenshot_decodes_at_the_stated_size(client, fmt):
    reply = client.call("screenshot", format=fmt, quality=70)
    img = _image(reply)
    assert img.format == fmt.upper()
    assert img.size == (reply.result["width"], reply.result["height"]) == SCREEN
    assert reply.result["scale"] == 1.0


def test_screenshot_downscale_and_region(client):
    reply = client.call("screenshot", max_long_edge=640)
    img = _image(reply)
    assert img.size == (640, 400) == (reply.result["width"], reply.result["height"])
    assert reply.result["scale"] == pytest.approx(2.0)

    reply = client.call("screenshot", format="png", region=[100, 50, 300, 200])
    img = _image(reply)
    assert img.size == (300, 200)
    assert (reply.result["x0"], reply.result["y0"]) == (100, 50)


def test_pointer_verbs_move_the_cursor(client):
    assert client.ok("move", x=300, y=200) == {}
    assert client.ok("cursor") == {"x": 300, "y": 200}
    client.ok("click", x=310, y=210, button="right", count=2)
    assert client.ok("cursor") == {"x": 310, "y": 210}
    client.ok("drag", x0=10, y0=10, x1=400, y1=300)
    assert client.ok("cursor") == {"x": 400, "y": 300}
    client.ok("scroll", dx=0, dy=3, x=_center("list")[0], y=_center("list")[1])
    assert client.ok("cursor") == dict(zip("xy", _center("list")))


def test_type_and_key_change_the_pixels(client):
    x, y, w, h = WIDGETS["text_field"]
    client.ok("click", x=x + 5, y=y + 5)
    before = bytes(client.call("screenshot", format="png", region=[x, y, w, h]).image)
    client.ok("type", text="héllo wörld ✓ 日本")
    typed = bytes(client.call("screenshot", format="png", region=[x, y, w, h]).image)
    assert typed != before
    client.ok("key", combo="ctrl+a")
    client.ok("key", combo="BackSpace")
    cleared = bytes(client.call("screenshot", format="png", region=[x, y, w, h]).image)
    assert cleared != typed


def test_screen_size_and_wait(client):
    assert client.ok("screen_size") == {"width": SCREEN[0], "height": SCREEN[1]}
    start = time.monotonic()
    assert client.ok("wait", ms=50) == {"waited_ms": 50}
    assert time.monotonic() - start >= 0.05


def test_wait_change_sees_a_change_from_another_connection(vdaemon, aci, client):
    other = aci(vdaemon.url, vdaemon.token)
    call_id = client.send("wait_change", timeout_ms=10_000)
    reply = None
    for i in range(50):  # keep changing the screen until the waiter has seen it
        other.ok("move", x=5 + i, y=5)
        try:
            reply = client.recv(0.1)
            break
        except TimeoutError:
            continue
    assert isinstance(reply, protocol.Reply), reply
    assert reply.call_id == call_id and reply.outcome == protocol.OK, reply
    assert reply.result["changed"] is True


def test_wait_change_and_wait_stable_time_out(client):
    reply = client.call("wait_change", timeout_ms=150)
    assert reply.outcome == protocol.TIMEOUT and reply.error.kind == protocol.ERR_TIMEOUT
    result = client.ok("wait_stable", stable_ms=100, timeout_ms=5000)
    assert result["stable"] is True and result["waited_ms"] >= 100


def test_exec_reports_exit_code_and_streams(client):
    result = client.ok("exec", cmd="printf out; printf err >&2; exit 7")
    assert (result["exit_code"], result["signal"]) == (7, None)
    assert (result["stdout"], result["stderr"]) == ("out", "err")
    assert result["stdout_truncated"] is result["stderr_truncated"] is False


def test_exec_stdin_env_cwd_base64(client, tmp_path):
    stdin = base64.b64encode(b"\x00\xffdata").decode()
    result = client.ok("exec", cmd="cat; printf \"$FOO\"; pwd", stdin=stdin, env={"FOO": "bar"},
                       cwd=str(tmp_path), encoding="base64")  # fmt: skip
    assert base64.b64decode(result["stdout"]) == b"\x00\xffdata" + b"bar" + str(tmp_path).encode() + b"\n"


def test_exec_truncates_output_past_the_cap(client):
    result = client.ok("exec", cmd="head -c 100000 /dev/zero | tr '\\0' a", max_output=1000)
    assert result["stdout"] == "a" * 1000 and result["stdout_truncated"] is True


def test_exec_timeout_kills_the_process_group(client, tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    reply = client.call("exec", cmd=f"sleep 30 & echo $! > {pidfile}; wait", timeout_ms=300)
    assert reply.outcome == protocol.TIMEOUT and reply.error.kind == protocol.ERR_TIMEOUT, reply
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while procfs.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not procfs.alive(pid), "the background grandchild survived the timeout"




def test_exec_signal_and_missing_cwd(client):
    result = client.ok("exec", cmd="kill -TERM $$")
    assert (result["exit_code"], result["signal"]) == (None, 15)
    reply = client.call("exec", cmd="true", cwd="/nonexistent/dir")
    assert reply.outcome == protocol.ERROR and reply.error.kind == protocol.ERR_NOT_FOUND


def test_files_round_trip_binary(client, tmp_path):
    data = bytes(range(256)) * 10 + os.urandom(1000)
    path = tmp_path / "sub" / "blob.bin"
    reply = client.call("write_file", path=str(path), data=base64.b64encode(data).decode())
    assert reply.outcome == protocol.ERROR and reply.error.kind == protocol.ERR_NOT_FOUND  # no sub/ yet
    result = client.ok("write_file", path=str(path), data=base64.b64encode(data).decode(), make_dirs=True,
                       mode=0o640)  # fmt: skip
    assert result["bytes_written"] == len(data)
    assert path.read_bytes() == data and (path.stat().st_mode & 0o777) == 0o640
    client.ok("write_file", path=str(path), data=base64.b64encode(b"tail").decode(), append=True)

    result = client.ok("read_file", path=str(path))
    assert base64.b64decode(result["data"]) == data + b"tail"
    assert result["size"] == len(data) + 4 and result["truncated"] is False
    part = client.ok("read_file", path=str(path), offset=10, max_bytes=5)
    assert base64.b64decode(part["data"]) == (data + b"tail")[10:15] and part["truncated"] is True


def test_read_missing_file_is_not_found(client, tmp_path):
    reply = client.call("read_file", path=str(tmp_path / "missing"))
    assert reply.outcome == protocol.ERROR and reply.error.kind == protocol.ERR_NOT_FOUND
    reply = client.call("read_file", path=str(tmp_path))
    assert reply.outcome == protocol.ERROR and reply.error.kind == protocol.ERR_FAILED


@pytest.mark.parametrize(
    ("verb", "args"),
    [
        ("screenshot", {"format": "gif"}),
        ("screenshot", {"quality": 0}),
        ("screenshot", {"region": [0, 0, 5000, 10]}),
        ("screenshot", {"max_long_edge": "big"}),
        ("click", {"x": 10}),
        ("click", {"x": -1, "y": 5}),
        ("click", {"x": 5, "y": SCREEN[1]}),
        ("click", {"x": 5, "y": 5, "button": "thumb"}),
        ("click", {"x": True, "y": 5}),
        ("click", {"x": 1.5, "y": 5}),
        ("move", {"x": 1, "y": 1, "z": 1}),
        ("drag", {"x0": 1, "y0": 1, "x1": 1}),
        ("scroll", {"dy": 1000}),
        ("type", {"text": 5}),
        ("key", {"combo": ""}),
        ("key", {"combo": "ctrl++"}),
        ("wait", {"ms": -1}),
        ("wait", {"ms": 10**9}),
        ("wait_stable", {"stable_ms": 0}),
        ("wait_change", {"timeout_ms": "soon"}),
        ("exec", {}),
        ("exec", {"cmd": "true", "timeout_ms": 0}),
        ("exec", {"cmd": "true", "env": {"A": 1}}),
        ("exec", {"cmd": "true", "stdin": "not base64!"}),
        ("read_file", {"path": ""}),
        ("read_file", {"path": "a\x00b"}),
        ("write_file", {"path": "/tmp/x"}),
        ("write_file", {"path": "/tmp/x", "data": "%%%"}),
        ("screencast_start", {"fps": 0}),
        ("screencast_start", {"fps": 1000}),
        ("screencast_stop", {}),
        ("resume_screencast", {"stream_id": "s", "params": 3}),
        ("cursor", {"x": 1}),
    ],
)
def test_bad_args_get_a_bad_args_error(client, verb, args):
    reply = client.call(verb, **args)
    assert reply.outcome == protocol.ERROR and reply.error.kind == protocol.ERR_BAD_ARGS, reply
    assert reply.error.message
    assert client.ok("screen_size")  # the connection carries on
