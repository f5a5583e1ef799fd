"""The ACI codec, byte for byte, with no sockets (shinken_sync.protocol)."""

import json
import struct

import pytest

from shinken_sync import protocol as p


def test_call_round_trip():
    text = p.encode_call(7, "click", {"x": 1, "y": 2})
    assert json.loads(text) == {"type": "call", "call_id": 7, "verb": "click", "args": {"x": 1, "y": 2}}
    assert p.decode_call(text) == p.Call(7, "click", {"x": 1, "y": 2})


def test_call_defaults_args_to_empty_object():
    assert p.decode_call('{"call_id":"a","verb":"cursor"}').args == {}


@pytest.mark.parametrize(
    "raw, kind, call_id",
    [
        ("not json", p.ERR_BAD_REQUEST, None),
        ("[1,2]", p.ERR_BAD_REQUEST, None),
        ('{"verb":"click"}', p.ERR_BAD_REQUEST, None),
        ('{"call_id":true,"verb":"click"}', p.ERR_BAD_REQUEST, None),
        ('{"call_id":3}', p.ERR_BAD_REQUEST, 3),
        ('{"call_id":3,"verb":"explode"}', p.ERR_UNKNOWN_VERB, 3),
        ('{"call_id":3,"verb":"click","args":[1]}', p.ERR_BAD_ARGS, 3),
        ('{"call_id":3,"type":"reply","verb":"click"}', p.ERR_BAD_REQUEST, 3),
    ],
)
def test_decode_call_rejects_with_kind_and_call_id(raw, kind, call_id):
    with pytest.raises(p.ProtocolError) as info:
        p.decode_call(raw)
    assert info.value.kind == kind
    assert info.value.call_id == call_id


def test_binary_call_is_rejected():
    with pytest.raises(p.ProtocolError):
        p.decode_call(b'{"call_id":1,"verb":"cursor"}')


def test_encode_call_refuses_bad_call_id():
    with pytest.raises(p.ProtocolError):
        p.encode_call(True, "cursor")


def test_reply_ok_and_error_round_trip():
    ok = p.decode_server_message(p.encode_reply(1, result={"x": 3}))
    assert ok == p.Reply(1, p.OK, result={"x": 3})
    err = p.decode_server_message(p.encode_error(2, p.ERR_BAD_ARGS, "x must be an int"))
    assert err.outcome == p.ERROR and err.error == p.ErrorInfo(p.ERR_BAD_ARGS, "x must be an int")
    anonymous = p.decode_server_message(p.encode_error(None, p.ERR_BAD_REQUEST, "not json"))
    assert anonymous.call_id is None


def test_daemon_cannot_send_client_side_outcomes():
    with pytest.raises(ValueError):
        p.encode_reply(1, p.SKIPPED)
    with pytest.raises(p.ProtocolError):
        p.decode_server_message('{"type":"reply","call_id":1,"outcome":"denied","result":{}}')


def test_image_reply_is_binary_and_zero_copy():
    meta = {"format": "jpeg", "width": 1280, "height": 720, "scale": 1.5, "x0": 0, "y0": 0}
    image = b"\xff\xd8" + bytes(range(256)) * 4
    msg = p.encode_image_reply(9, meta, image)
    assert isinstance(msg, bytes)
    (head_len,) = struct.unpack(">I", msg[:4])
    assert json.loads(msg[4 : 4 + head_len])["call_id"] == 9
    assert msg.endswith(image)  # raw bytes, no base64
    reply = p.decode_server_message(msg)
    assert isinstance(reply.image, memoryview) and bytes(reply.image) == image
    assert reply.result["scale"] == 1.5


def test_frame_round_trip():
    meta = {"format": "png", "width": 4, "height": 3, "scale": 1.0, "x0": 5, "y0": 6, "ts": 12.5}
    frame = p.decode_server_message(p.encode_frame("s1", 42, meta, b"PNGDATA"))
    assert isinstance(frame, p.Frame)
    assert (frame.stream_id, frame.seq, frame.x0, frame.y0, frame.ts) == ("s1", 42, 5, 6, 12.5)
    assert bytes(frame.image) == b"PNGDATA"


def test_hello_and_stream_end_round_trip():
    hello = p.Hello(p.PROTOCOL_VERSION, "sb-1", 1920, 1080, ("click", "screenshot"), "virtual")
    assert p.decode_server_message(p.encode_hello(hello)) == hello
    end = p.decode_server_message(p.encode_stream_end("s1", "stopped", 17))
    assert end == p.StreamEnd("s1", "stopped", 17)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00\x00",
        struct.pack(">I", 100) + b"{}",  # header length past the end
        struct.pack(">I", p.MAX_BINARY_HEADER + 1) + b"x" * 10,
        struct.pack(">I", 2) + b"[]",
        struct.pack(">I", 16) + b'{"type":"bogus"}',
        p.pack_binary({"type": "frame", "stream_id": "s", "seq": 1, "format": "gif", "width": 1,
                       "height": 1, "scale": 1}, b""),
        p.pack_binary({"type": "frame", "stream_id": "s", "seq": "1", "format": "png", "width": 1,
                       "height": 1, "scale": 1}, b""),
    ],
)
def test_malformed_binary_messages_raise_protocol_error(data):
    with pytest.raises(p.ProtocolError):
        p.decode_server_message(data)


@pytest.mark.parametrize(
    "text",
    ["{", '"hello"', '{"type":"what"}', '{"type":"hello","protocol":1}',
     '{"type":"reply","call_id":1,"outcome":"ok","result":[]}',
     '{"type":"reply","call_id":1,"outcome":"error","error":"boom"}'],
)
def test_malformed_text_messages_raise_protocol_error(text):
    with pytest.raises(p.ProtocolError):
        p.decode_server_message(text)
