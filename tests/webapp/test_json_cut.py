"""``loads_strict`` cuts long base64 data URLs out of the text before decoding: the same value
and the same errors as decoding the whole text (``webapp.limits._loads_text``)."""

from __future__ import annotations

import base64
import json
import random
from typing import Any

import pytest

from webapp.limits import _cut_data_urls, _loads_text, loads_strict, loads_strict_urls
from webapp.session_errors import SessionError

PAYLOAD = base64.b64encode(random.Random(1).randbytes(6000)).decode()
URL = "data:image/png;base64," + PAYLOAD
JPEG_URL = "data:image/jpeg;base64," + PAYLOAD[:-8]


def outcome(fn: Any, body: bytes) -> tuple[str, Any]:
    try:
        return "value", fn(body)
    except (SessionError, ValueError) as exc:
        return type(exc).__name__, str(exc)


def whole(body: bytes) -> Any:
    return _loads_text(str(body, "utf-8"), 64)


def image_body(*urls: str) -> dict[str, Any]:
    return {"model": "m", "messages": [
        {"role": "system", "content": "You operate a desktop."},
        *({"role": "user", "content": [{"type": "text", "text": f"turn {k}"},
                                       {"type": "image_url", "image_url": {"url": url}}]} for k, url in enumerate(urls))]}


def test_image_parts_are_cut_and_put_back() -> None:
    body = json.dumps(image_body(URL, JPEG_URL, URL)).encode()
    cut = _cut_data_urls(body.decode())
    assert cut is not None and cut[1] == [URL, JPEG_URL, URL]
    assert len(cut[0]) < 600  # the decoder sees the rest only
    assert loads_strict(body) == json.loads(body)


@pytest.mark.parametrize("value", [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": URL}]}], "x": [URL, URL]},  # anywhere
    {URL: 1, "a": {URL: [URL]}},  # keys are never cut, values are
    {"a": "\u0000" + "0", "b": URL},  # a client's NUL string: nothing cut, nothing mistaken
    {"a": "\u00001", "b": [URL, URL]},
    {"a": "x\\" + URL, "b": "\\\\\"" + URL},  # escapes right before the URL text
    {"a": URL + "\\", "b": URL + "\u00e9", "c": URL + "\n", "d": URL[:-1] + "*", "e": URL[:-3]},  # not base64
    {"a": "DATA:IMAGE/PNG;base64," + PAYLOAD, "b": "data:image/gif;base64," + PAYLOAD},
    [URL, [URL, {"k": URL}]],
])
def test_same_value_as_decoding_the_whole_text(value: Any) -> None:
    for body in (json.dumps(value).encode(), json.dumps(value, indent=2).encode(),
                 json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()):
        assert outcome(loads_strict, body) == ("value", value) == outcome(whole, body)


@pytest.mark.parametrize("body", [
    b'{"a": "x:"data:image/png;base64,' + PAYLOAD.encode() + b'"}',  # a closing quote before data:
    b'{"a": ["data:image/png;base64,' + PAYLOAD.encode() + b'" "b"]}',
    b'{"a": ["data:image/png;base64,' + PAYLOAD.encode() + b'",]}',
    b'{"a": ["data:image/png;base64,' + PAYLOAD.encode() + b'"], "n": NaN}',
    b'{"a": ["data:image/png;base64,' + PAYLOAD.encode() + b'"], "s": "\\ud800"}',
    b'{"a": ["data:image/png;base64,' + PAYLOAD.encode() + b'"], "d": ' + b"[" * 70 + b"]" * 70 + b"}",
    b'{"a": ["data:image/png;base64,' + PAYLOAD.encode() + b'"]',
    b'["data:image/png;base64,' + PAYLOAD.encode() + b'"]\xff',
])
def test_same_error_as_decoding_the_whole_text(body: bytes) -> None:
    got = outcome(loads_strict, body)
    assert got[0] != "value"
    assert got == outcome(lambda b: loads_strict(b[:0] + b), body)  # deterministic
    if got[0] != "InvalidJSON" or "utf-8" not in got[1]:
        assert got == outcome(whole, body)


def test_mutated_image_bodies_decode_as_the_whole_text() -> None:
    """Random byte edits of a screenshot turn's body: value or error, always the whole text's."""
    rng = random.Random(7)
    base = json.dumps(image_body(URL, JPEG_URL), indent=rng.choice([None, 1])).encode()
    alphabet = b'"\\:,[]{} \n\x00aZ09+/=\xc3\xa9'
    for _ in range(400):
        body = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(body))
            body[at:at + rng.randint(0, 2)] = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 2)))
        data = bytes(body)
        try:
            str(data, "utf-8")
        except UnicodeDecodeError:
            continue
        assert outcome(loads_strict, data) == outcome(whole, data)


def test_many_short_data_urls_bound_the_scan_and_decode_alike() -> None:
    """Short '"data:image/' strings are looked at a bounded number of times; the long ones
    past that bound are decoded with the rest (same value)."""
    value = {"a": ["data:image/png;base64,AAAA"] * 5000, "b": [URL] * 3}
    body = json.dumps(value).encode()
    cut = _cut_data_urls(body.decode())
    assert cut is None or len(cut[1]) < 3  # the budget ran out among the short ones
    assert loads_strict(body) == value
    value = {"b": [URL] * 3, "a": ["data:image/png;base64,AAAA"] * 5000}
    cut = _cut_data_urls(json.dumps(value))
    assert cut is not None and cut[1] == [URL] * 3
    assert loads_strict(json.dumps(value).encode()) == value


def test_the_cut_urls_are_views_of_the_body_for_the_very_strings_put_back() -> None:
    """``loads_strict_urls``: each cut URL's text as the body's own bytes (a view, no copy),
    found by the string the value holds and by no other string of the same text; none for a
    body that is not ASCII (its characters are not its bytes) or that nothing was cut from."""
    body = json.dumps(image_body(URL, JPEG_URL, URL)).encode()
    value, urls = loads_strict_urls(body)
    assert value == json.loads(body)
    parts = [m["content"][1]["image_url"]["url"] for m in value["messages"][1:]]
    for url in parts:
        view = urls.get(url)
        assert isinstance(view, memoryview) and view.obj is body and view.tobytes() == url.encode()
    assert urls.get("".join(URL)) is None and urls.get(PAYLOAD) is None  # equal text, another string
    accented = json.dumps(image_body(URL) | {"model": "modèle"}, ensure_ascii=False).encode()
    value, urls = loads_strict_urls(accented)
    assert value == json.loads(accented) and urls.get(value["messages"][1]["content"][1]["image_url"]["url"]) is None
    value, urls = loads_strict_urls(json.dumps(image_body("data:image/png;base64,AAAA")).encode())
    assert urls.get(value["messages"][1]["content"][1]["image_url"]["url"]) is None
