"""Screencast streams: frames, idle suppression, stop, resume with the seq gap, grace expiry."""

from __future__ import annotations

import io
import time

import pytest
from PIL import Image

from shinken_sync import protocol

pytestmark = pytest.mark.integration

FPS = 20


def _call_collecting(client, verb, **args):
    """Call, returning (reply, frames and stream_ends that arrived before it)."""
    call_id = client.send(verb, **args)
    pushed = []
    while True:
        msg = client.recv()
        if isinstance(msg, protocol.Reply):
            assert msg.call_id == call_id, msg
            return msg, pushed
        pushed.append(msg)


def _next_frame(client, timeout=10.0) -> protocol.Frame:
    msg = client.recv(timeout)
    assert isinstance(msg, protocol.Frame), msg
    return msg


def _no_message_for(client, seconds: float) -> None:
    with pytest.raises(TimeoutError):
        msg = client.recv(seconds)
        pytest.fail(f"expected silence, got {msg}")


def test_frames_carry_stream_id_seq_and_decode(vdaemon, aci):
    client = aci(vdaemon.url, vdaemon.token)
    reply, early = _call_collecting(client, "screencast_start", fps=FPS, max_long_edge=320, quality=50)
    stream_id = reply.result["stream_id"]
    frame = early[0] if early else _next_frame(client)
    assert (frame.stream_id, frame.seq) == (stream_id, 1)
    img = Image.open(io.BytesIO(bytes(frame.image)))
    assert img.format == "JPEG" and img.size == (frame.width, frame.height) == (320, 200)
    assert frame.scale == pytest.approx(4.0)
    reply, pushed = _call_collecting(client, "screencast_stop", stream_id=stream_id)
    assert reply.result == {"stream_id": stream_id, "last_seq": 1}
    assert [(m.stream_id, m.reason, m.last_seq) for m in pushed if isinstance(m, protocol.StreamEnd)] == [
        (stream_id, "stopped", 1)
    ]


def test_idle_screen_sends_no_frames_and_a_change_sends_one(vdaemon, aci):
    client = aci(vdaemon.url, vdaemon.token)
    reply, early = _call_collecting(client, "screencast_start", fps=FPS, max_long_edge=320)
    stream_id = reply.result["stream_id"]
    first = early[0] if early else _next_frame(client)
    assert first.seq == 1
    _no_message_for(client, 0.6)  # 12 ticks of an unchanged screen: suppressed
    reply, pushed = _call_collecting(client, "move", x=100, y=100)
    frame = pushed[0] if pushed else _next_frame(client)
    assert (frame.stream_id, frame.seq) == (stream_id, 2)
    _no_message_for(client, 0.4)
    client.ok("screencast_stop", stream_id=stream_id)


def test_resume_on_another_connection_continues_seq_across_the_gap(vdaemon, aci):
    first = aci(vdaemon.url, vdaemon.token)
    reply, early = _call_collecting(first, "screencast_start", fps=FPS, max_long_edge=320)
    stream_id = reply.result["stream_id"]
    last_seen = (early[0] if early else _next_frame(first)).seq
    first.close()  # the viewer drops

    second = aci(vdaemon.url, vdaemon.token)
    for i in range(3):  # changes while nobody watches, several ticks apart
        second.ok("move", x=200 + i, y=200)
        time.sleep(0.3)
    reply, early = _call_collecting(second, "resume_screencast", stream_id=stream_id, params={"quality": 40})
    result = reply.result
    assert result["stream_id"] == stream_id and result["quality"] == 40 and result["fps"] == FPS
    assert result["missed"] >= 1
    frame = early[0] if early else _next_frame(second)
    assert frame.stream_id == stream_id
    # seq counted every frame the stream would have sent while detached
    assert frame.seq == result["last_seq"] + 1 == last_seen + result["missed"] + 1
    second.ok("screencast_stop", stream_id=stream_id)


def test_resume_while_attached_elsewhere_moves_the_stream(vdaemon, aci):
    owner = aci(vdaemon.url, vdaemon.token)
    reply, _ = _call_collecting(owner, "screencast_start", fps=FPS)
    stream_id = reply.result["stream_id"]
    thief = aci(vdaemon.url, vdaemon.token)
    reply, _ = _call_collecting(thief, "resume_screencast", stream_id=stream_id)
    assert reply.outcome == protocol.OK
    deadline = time.monotonic() + 10
    while True:
        msg = owner.recv(max(0.0, deadline - time.monotonic()))
        if isinstance(msg, protocol.StreamEnd):
            break
    assert (msg.stream_id, msg.reason) == (stream_id, "moved")
    thief.ok("screencast_stop", stream_id=stream_id)


def test_unknown_stream_is_not_found(vdaemon, aci):
    client = aci(vdaemon.url, vdaemon.token)
    for verb in ("resume_screencast", "screencast_stop"):
        reply = client.call(verb, stream_id="s-nope")
        assert reply.outcome == protocol.ERROR and reply.error.kind == protocol.ERR_NOT_FOUND


def test_a_detached_stream_ends_after_the_grace_period(shinkend, aci):
    daemon = shinkend(args=["--stream-grace", "0.3"])
    client = aci(daemon.url, daemon.token)
    reply, _ = _call_collecting(client, "screencast_start", fps=5)
    stream_id = reply.result["stream_id"]
    client.close()
    time.sleep(1.0)
    reply = aci(daemon.url, daemon.token).call("resume_screencast", stream_id=stream_id)
    assert reply.outcome == protocol.ERROR and reply.error.kind == protocol.ERR_NOT_FOUND
