"""Interop: the raw protocol through websocket-client, a second WebSocket implementation.

Nothing from shinken_sync is used to build or parse messages here, so this also
checks that docs/protocol.md describes the wire format completely.
"""

from __future__ import annotations

import io
import json
import struct

import pytest
import websocket
from PIL import Image

pytestmark = pytest.mark.integration


def _connect(daemon, token):
    return websocket.create_connection(daemon.url, header=[f"Authorization: Bearer {token}"], timeout=20)


def test_websocket_client_speaks_the_protocol(vdaemon):
    ws = _connect(vdaemon, vdaemon.token)
    try:
        hello = json.loads(ws.recv())
        assert hello["type"] == "hello" and hello["protocol"] == 1
        width, height = hello["screen"]["width"], hello["screen"]["height"]

        ws.send(json.dumps({"type": "call", "call_id": "c1", "verb": "move", "args": {"x": 1, "y": 2}}))
        ws.send(json.dumps({"type": "call", "call_id": "c2", "verb": "screenshot",
                            "args": {"format": "png", "max_long_edge": 400}}))  # fmt: skip
        reply = json.loads(ws.recv())
        assert reply == {"type": "reply", "call_id": "c1", "outcome": "ok", "result": {}}

        opcode, data = ws.recv_data()
        assert opcode == websocket.ABNF.OPCODE_BINARY
        (head_len,) = struct.unpack(">I", data[:4])
        header = json.loads(data[4 : 4 + head_len])
        assert header["type"] == "reply" and header["call_id"] == "c2" and header["outcome"] == "ok"
        image = Image.open(io.BytesIO(data[4 + head_len :]))
        assert image.format == "PNG"
        assert image.size == (header["result"]["width"], header["result"]["height"])
        assert max(image.size) == 400 and header["result"]["scale"] == pytest.approx(max(width, height) / 400)

        ws.send("garbage")
        assert json.loads(ws.recv())["error"]["kind"] == "bad_request"
    finally:
        ws.close()


def test_websocket_client_gets_401_for_a_wrong_token(vdaemon):
    with pytest.raises(websocket.WebSocketBadStatusException) as info:
        _connect(vdaemon, "wrong")
    assert info.value.status_code == 401
