"""The demo's outputs without processes: the consistency check, the contact sheet, the
trajectory file format and the X screen program's input decoding."""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import subprocess
import sys

import pytest
from PIL import Image

from shinken_sync.demo import (
    CONTACT_SHEET_TILES,
    Episode,
    check_episode,
    contact_sheet,
    describe_step,
    run_consistent,
)
from shinken_sync.demo.screen import describe_input, key_name
from shinken_sync.trajectory_file import compact_records, expand_records

ACTION = {"verb": "key", "combo": "Return"}


def _jpeg(color: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 36), color).save(buf, "JPEG")
    return buf.getvalue()


def _episode(index: int, shas: list[str]) -> Episode:
    """An episode whose records agree with its steps; ``shas``: first observation, then one per step."""
    ep = Episode(index=index, sandbox_id=f"sb{index}", session_id=f"{index:08d}", finished=True,
                 final_jpeg=_jpeg("white"), first_observation={"sha256": shas[0]})
    content = '{"action": {"verb": "key", "combo": "Return"}}'
    for turn, sha in enumerate(shas[1:]):
        ep.steps.append({"turn": turn, "action": ACTION, "outcome": "ok", "error": None,
                         "observation": {"sha256": sha}})
        # the screenshot sent this turn (the one before the step), as the session server holds it
        data = shas[turn].encode()
        ep.sent_images.append(hashlib.sha256(data).hexdigest())
        ep.images[ep.sent_images[-1]] = data
        ep.records.append({"request": {"input_ids": [1, 2], "image_data": [f"sha256:{d}" for d in ep.sent_images]},
                           "response": {"choices": [{"message": {"content": content},
                                                     "meta_info": {"output_token_logprobs": [[-0.1, 3]]}}]}})
    ep.metadata = {"accumulated_token_ids": [1, 2, 3]}
    return ep


def test_a_run_whose_screens_never_change_is_not_consistent():
    frozen = [_episode(i, ["a", "a", "a"]) for i in range(3)]
    assert all(check_episode(ep)["observation_changes"] == 0 for ep in frozen)
    assert run_consistent(frozen) is False
    lively = [_episode(0, ["a", "b", "b"]), *frozen[1:]]
    assert check_episode(lively[0])["observation_changes"] == 1
    assert run_consistent(lively) is True


def test_records_must_name_the_screenshots_sent_with_their_bytes():
    ep = _episode(0, ["a", "b", "c"])
    assert check_episode(ep)["images_match_records"] is True
    ep.records[1]["request"]["image_data"].reverse()  # out of order
    assert check_episode(ep)["images_match_records"] is False
    ep = _episode(0, ["a", "b", "c"])
    ep.images[ep.sent_images[0]] = b"other pixels"
    assert check_episode(ep)["images_match_records"] is False
    assert run_consistent([ep]) is False


def test_contact_sheet_samples_above_16_episodes(tmp_path):
    many = [_episode(i, ["a", "b"]) for i in range(40)]
    contact_sheet(many, tmp_path / "many.png")
    few = [_episode(i, ["a", "b"]) for i in range(4)]
    contact_sheet(few, tmp_path / "few.png")
    big, small = Image.open(tmp_path / "many.png"), Image.open(tmp_path / "few.png")
    side = int(CONTACT_SHEET_TILES ** 0.5)
    assert big.width == side * 480 and small.width == 2 * 480  # 4x4 tiles, not 7x6
    assert small.height < big.height < 2 * small.height  # 4 rows of tiles against 2, one header each


def test_step_descriptions_name_the_action_and_outcome():
    assert describe_step({"action": {"verb": "click", "x": 812, "y": 440, "button": "left"}, "outcome": "ok",
                          "error": None}) == "click (812, 440) -> ok"
    assert describe_step({"action": {"verb": "type", "text": "hello"}, "outcome": "error",
                          "error": {"type": "BadArgs"}}) == "type 'hello' -> error (BadArgs)"
    assert describe_step({"action": {"verb": "scroll", "x": 1, "y": 2, "dy": -3}, "outcome": "ok",
                          "error": None}) == "scroll (1, 2) dy -3 -> ok"
    assert describe_step(None) == "no step taken"


def _r3(rows: int, salt: int) -> str:
    """rows x (2 layers x 2 top_k) int32; row i's values depend on i only (and salt)."""
    return base64.b64encode(b"".join(struct.pack("<4i", *(i * 10 + salt + k for k in range(4)))
                                     for i in range(rows))).decode()


def _record(prompt: list[int], output: list[int], messages: list[dict], salt: int = 0) -> dict:
    """A miles SessionRecord: the backend request (input_ids) and its verbatim reply."""
    return {"timestamp": 1.0, "method": "POST", "path": "/v1/chat/completions", "status_code": 200,
            "request": {"model": "m", "messages": messages, "input_ids": prompt},
            "response": {"choices": [{"message": {"content": "x"},
                                      "meta_info": {"completion_tokens": len(output),
                                                    "output_token_logprobs": [[-0.1, t] for t in output],
                                                    "routed_experts": _r3(len(prompt) + len(output) - 1, salt)}}]}}


def test_trajectory_records_are_stored_once_and_expand_back(tmp_path):
    m1 = [{"role": "user", "content": "a"}]
    m2 = m1 + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "b"}]
    records = [
        _record([1, 2, 3], [4, 5], m1),
        _record([1, 2, 3, 4, 5, 6, 7], [8, 9], m2),
        _record([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11], m2 + [{"role": "user", "content": "c"}]),
        _record([1, 2, 30], [31], m1, salt=7),  # a rollback: stored whole
    ]
    with open(tmp_path / "r3.bin", "wb") as r3:
        compact = compact_records(records, r3, "r3.bin")
    data = (tmp_path / "r3.bin").read_bytes()
    assert compact[1]["request"]["input_ids_from_previous"] == 5
    assert compact[1]["request"]["input_ids_new"] == [6, 7] and "input_ids" not in compact[1]["request"]
    assert compact[1]["request"]["messages_new"] == m2[1:] and "messages" not in compact[1]["request"]
    assert compact[3]["request"]["input_ids"] == [1, 2, 30]
    refs = [c["response"]["choices"][0]["meta_info"]["routed_experts"] for c in compact]
    assert [r["first_row"] for r in refs] == [0, 4, 8, 0]
    # every token's row is stored once, plus the rollback's whole sequence
    assert len(data) == (4 + 4 + 2 + 3) * 16
    assert expand_records(compact, data) == records


@pytest.mark.parametrize("key", ["input_ids", "messages", "image_data"])
def test_a_first_compact_record_that_refers_to_a_previous_one_is_a_value_error(key):
    # Only a damaged file starts with a prefix reference; every list refused alike, as a ValueError.
    compact = [{"request": {"model": "m", f"{key}_from_previous": 1, f"{key}_new": [2]}}]
    with pytest.raises(ValueError, match="refers to a previous record"):
        expand_records(compact, b"")


def test_the_x_screen_program_names_every_input():
    data = b"hi\x1b[<0;12;5M\x1b[<0;12;5m\x1b[<65;3;4M\r\x1b\x13\x1b[1;3S\x7fab"
    assert list(describe_input(data)) == [
        ("typed", "hi", None), ("left click", "at column 12, row 5", (12, 5)),
        ("scroll down", "at column 3, row 4", None), ("key", "Return", None), ("key", "Escape", None),
        ("key", "ctrl+s", None), ("key", "alt+F4", None), ("key", "BackSpace", None), ("typed", "ab", None),
    ]


@pytest.mark.parametrize(("sequence", "name"), [
    ("[1;3S", "alt+F4"), ("OP", "F1"), ("[A", "Up"), ("[1;5D", "ctrl+Left"), ("[15~", "F5"),
    ("[24;2~", "shift+F12"), ("[3~", "Delete"), ("[1;7H", "ctrl+alt+Home"), ("[99~", "[99~"), ("[?25h", "[?25h"),
])
def test_key_sequences_are_named_as_xdotool_names_the_keys(sequence, name):
    # xterm's encoding of function and cursor keys with modifiers (its ctlseqs document)
    assert key_name(sequence) == name


def test_the_demo_and_the_cli_import_no_webapp_until_they_start_the_session_server() -> None:
    # shinken_sync must install and import without the session server's stack; the demo goes
    # through webapp.serve.start_session_server (the one launcher) only when it runs.
    code = ("import sys, shinken_sync.demo, shinken_sync.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('webapp', 'gunicorn', 'flask')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]"
