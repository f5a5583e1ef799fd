"""Verb argument validation (pure; no daemon)."""

from __future__ import annotations

import base64

import pytest

from shinken_sync import protocol
from shinken_sync.daemon.args import MAX_FILE_BYTES, SPECS, Screen, validate
from shinken_sync.daemon.errors import BadArgs

SCREEN = Screen(1920, 1080)


def test_every_verb_has_a_spec():
    assert set(SPECS) == protocol.VERBS


def test_defaults_are_filled_in():
    assert validate("screenshot", {}, SCREEN) == {"format": "jpeg", "quality": 80, "max_long_edge": None,
                                                  "region": None}  # fmt: skip
    assert validate("click", {"x": 1, "y": 2.0}, SCREEN) == {"x": 1, "y": 2, "button": "left", "count": 1}


def test_coordinates_are_checked_against_the_screen():
    assert validate("move", {"x": 1919, "y": 1079}, SCREEN) == {"x": 1919, "y": 1079}
    for x, y in ((1920, 0), (0, 1080), (-1, 0)):
        with pytest.raises(BadArgs, match="out of range"):
            validate("move", {"x": x, "y": y}, SCREEN)
    assert validate("screenshot", {"region": [1900, 1000, 20, 80]}, SCREEN)["region"] == (1900, 1000, 20, 80)
    with pytest.raises(BadArgs, match=r"region\[2\]"):
        validate("screenshot", {"region": [1900, 1000, 21, 80]}, SCREEN)


def test_unknown_and_missing_arguments_are_named():
    with pytest.raises(BadArgs, match="unknown argument.*'timout_ms'"):
        validate("wait_change", {"timout_ms": 5}, SCREEN)
    with pytest.raises(BadArgs, match="missing required argument 'cmd'"):
        validate("exec", {}, SCREEN)


def test_error_kind_is_bad_args():
    with pytest.raises(BadArgs) as info:
        validate("wait", {"ms": "1"}, SCREEN)
    assert info.value.kind == protocol.ERR_BAD_ARGS and info.value.outcome == protocol.ERROR


def test_base64_is_decoded_and_capped_before_decoding():
    assert validate("write_file", {"path": "p", "data": base64.b64encode(b"\0\1").decode()}, SCREEN)["data"] == b"\0\1"
    too_big = "A" * ((MAX_FILE_BYTES + 2) // 3 * 4 + 4)
    with pytest.raises(BadArgs, match="more than"):
        validate("write_file", {"path": "p", "data": too_big}, SCREEN)


def test_resume_params_flat_or_nested_but_not_both():
    nested = validate("resume_screencast", {"stream_id": "s", "params": {"fps": 2}}, SCREEN)
    flat = validate("resume_screencast", {"stream_id": "s", "fps": 2}, SCREEN)
    assert nested == flat and flat["fps"] == 2.0 and flat["quality"] is None
    with pytest.raises(BadArgs, match="both"):
        validate("resume_screencast", {"stream_id": "s", "fps": 2, "params": {"fps": 3}}, SCREEN)


@pytest.mark.parametrize("combo", ["ctrl+shift+t", "Return", "a", "+", "ctrl+plus"])
def test_key_combos(combo):
    assert validate("key", {"combo": combo}, SCREEN)["combo"] == combo


@pytest.mark.parametrize("combo", ["", "ctrl+", "+a", "ctrl++"])
def test_bad_key_combos(combo):
    with pytest.raises(BadArgs):
        validate("key", {"combo": combo}, SCREEN)
