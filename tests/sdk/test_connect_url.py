"""A malformed sandbox URL is one typed error (``InvalidURL``: a ``ConnectError`` and a
``ValueError``), raised before anything is dialed, from ``connect`` and ``aconnect`` alike."""

from __future__ import annotations

import asyncio
import socket

import pytest

import shinken_sync
from shinken_sync import ConnectError, InvalidURL

BAD = [
    "ws://host:port/sb/0",  # the README's placeholder, verbatim: urllib's bare ValueError before
    "ws://127.0.0.1:99999/sb/0",  # port out of range: a bare ValueError before
    "ws://[::1/sb/0",  # unclosed IPv6 bracket: a bare ValueError before
    "http://127.0.0.1:{port}/sb/0",
    "127.0.0.1:{port}",
    "ws://:{port}/sb/0",
    "ws://",
    "",
    "ws://127.0.0 .1:{port}/sb/0",
]


@pytest.fixture
def listener():
    """A loopback port that would accept a dial: the test checks none was made."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sock.setblocking(False)
        yield sock


def _assert_not_dialed(sock: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        sock.accept()


@pytest.mark.parametrize("url", BAD)
def test_connect_refuses_a_malformed_url_with_a_typed_error(url, listener):
    url = url.format(port=listener.getsockname()[1])
    with pytest.raises(InvalidURL) as info:
        shinken_sync.connect(url, token="t" * 16, open_timeout=2)
    assert isinstance(info.value, ConnectError) and isinstance(info.value, ValueError)
    assert info.value.url == url
    assert "ws://127.0.0.1:PORT/sb/0" in str(info.value) and "shinken sandboxes" in str(info.value)
    _assert_not_dialed(listener)


@pytest.mark.parametrize("url", BAD)
def test_aconnect_refuses_a_malformed_url_with_a_typed_error(url, listener):
    url = url.format(port=listener.getsockname()[1])
    with pytest.raises(InvalidURL):
        asyncio.run(shinken_sync.aconnect(url, token="t" * 16, open_timeout=2))
    _assert_not_dialed(listener)


def test_a_well_formed_url_that_nobody_serves_is_a_connect_error_not_invalid():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(ConnectError) as info:
            shinken_sync.connect(f"ws://127.0.0.1:{port}/sb/0", token="t" * 16, open_timeout=2)
    assert not isinstance(info.value, InvalidURL)
