"""The records GET's session metadata made cheaply on a long session's first GET: the same
bytes as ``json.dumps`` of the metadata (the ids' text spliced in), the special-token split
of ``tito_session_mismatch`` and the ids text's prefixes against their plain definitions."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from tests.webapp.test_core import body_of, chat, make_core, new_session
from webapp.core import _metadata_json
from webapp.records import IdsText, ids_json
from webapp.tito import _segments


def _compact(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


@pytest.mark.parametrize("metadata", [
    {"accumulated_token_ids": [], "num_records": 0},
    {"accumulated_token_ids": [7]},
    {"tito_session_mismatch": [], "accumulated_token_ids": [1, 22, 333], "max_trim_tokens": 0,
     "num_records": 2, "num_rollbacks": 0, "num_messages": 3, "created_at": 1733.5},
    {"tito_session_mismatch": [{"type": "assistant_text", "segment_index": 4, "expected_text": "a\u00e9\"",
                                "actual_text": "\n", "detail": ""}],
     "accumulated_token_ids": list(range(300)), "tree": {"nodes": [{"a": None}]}, "num_records": 1},
    {"max_trim_tokens": 0, "accumulated_token_ids": [5, 6]},
])
def test_the_metadata_json_is_json_dumps_with_the_ids_text_spliced_in(metadata):
    assert _metadata_json(metadata, ids_json(metadata["accumulated_token_ids"])) == _compact(metadata)


def test_the_served_metadata_is_the_compact_json_of_itself_clean_and_with_a_mismatch():
    core = make_core()
    sid = new_session(core)
    first = [{"role": "user", "content": "a\u00e9 <b>" * 50}]
    r1 = body_of(chat(core, sid, first))["choices"][0]["message"]
    chat(core, sid, first + [r1, {"role": "user", "content": "more"}])
    for tamper in (False, True):
        if tamper:  # a TITO bug's shape: the mismatch list is not empty
            session = core.registry.get(sid)
            ids = list(session.state.token_ids)
            ids[3] = ord("Z")
            session.state = dataclasses.replace(session.state, token_ids=tuple(ids))
        raw = core.get_session(sid).read()
        metadata = json.loads(raw)["metadata"]
        assert bool(metadata["tito_session_mismatch"]) is tamper
        assert raw.endswith(b',"metadata":' + _compact(metadata) + b"}")
    core.close()


def _segments_per_id(ids: list[int], special: frozenset[int]) -> list[tuple[bool, list[int]]]:
    """The definition: each special token alone, runs of others together."""
    out: list[tuple[bool, list[int]]] = []
    for tid in ids:
        if tid in special:
            out.append((True, [tid]))
        elif out and not out[-1][0]:
            out[-1][1].append(tid)
        else:
            out.append((False, [tid]))
    return out


def test_the_special_token_split_matches_its_definition():
    rng = random.Random(3)
    special = frozenset({0, 1, 2})
    cases = [[], [0], [5], [0, 0], [5, 5], [0, 5, 5, 1], [5, 0, 5]]
    cases += [[rng.randrange(6) for _ in range(rng.randrange(20))] for _ in range(500)]
    for ids in cases:
        assert _segments(ids, special) == _segments_per_id(ids, special), ids


def test_every_prefix_of_the_ids_text_is_the_json_of_that_prefix():
    rng = random.Random(5)
    for ids in ([], [0], [12, 3], [rng.randrange(10**6) for _ in range(400)]):
        text = IdsText(ids)
        assert text.text == ids_json(ids)
        for n in range(len(ids) + 1):
            assert text.prefix(n) == ids_json(ids[:n])
            assert text.prefix(n).obj is text.text  # a view: a GET's records share the one text
