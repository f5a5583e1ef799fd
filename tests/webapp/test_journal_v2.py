"""Journal format 2 against format 1: the same records GET bytes, a format 1 data dir still
served and continued, disk linear in turns.

``journal_v1/`` was written by the last tree that wrote format 1 (see
``journal_conversations.py`` for the command): its ``expected/`` are that tree's records GETs.
Every file a test writes is under ``tmp_path``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from . import journal_conversations as jc

FIXTURE = Path(__file__).parent / "journal_v1"
NAMES = sorted(p.name for p in (FIXTURE / "expected").iterdir())


def expected(name: str) -> bytes:
    return (FIXTURE / "expected" / name).read_bytes()


def test_the_records_get_is_byte_identical_to_format_1s_for_the_same_conversations(tmp_path):
    """Images, a rollback, tool calls and R3; then again after a restart (read back from disk)."""
    with jc.fixed_clock():
        core = jc.core_on(str(tmp_path))
        sids = jc.play(core)
        got = jc.gets(core, sids)
        core.close()
    assert sorted(got) == NAMES
    for name in NAMES:
        assert got[name] == expected(name), name
    again = jc.core_on(str(tmp_path))
    for name, body in jc.gets(again, sids).items():
        assert body == expected(name), name
    journal = sum(p.stat().st_size for p in (tmp_path / "sessions").iterdir())
    v1 = sum(p.stat().st_size for p in (FIXTURE / "data" / "sessions").iterdir())
    assert journal < v1 / 2, (journal, v1)


def test_a_format_1_data_dir_is_served_and_continued(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(FIXTURE / "data", data)
    core = jc.core_on(str(data))
    sids = [name[:-len(".json")] for name in NAMES if not name.endswith(".images.json")]
    for name, body in jc.gets(core, sids).items():
        assert body == expected(name), name
    before = json.loads(expected("plain.json"))
    last = before["records"][-1]
    msgs = last["request"]["messages"] + [last["response"]["choices"][0]["message"],
                                          {"role": "user", "content": "one more"}]
    msgs[-2] = {k: v for k, v in msgs[-2].items() if v is not None}
    jc._chat(core, "plain", msgs)  # a format 2 entry after the format 1 ones
    after = core.get_session("plain").read()
    again = jc.core_on(str(data))
    assert again.get_session("plain").read() == after
    records = json.loads(after)["records"]
    assert len(records) == len(before["records"]) + 1
    assert records[:-1] == before["records"]
    assert again.samples("plain", b"{}").status == 200


def _plain_journal(tmp_path: Path, turns: int) -> int:
    core = jc.core_on(str(tmp_path / f"t{turns}"))
    assert core.create_session("s").status == 200
    msgs: list = []
    for i in range(turns):
        msgs.append({"role": "user", "content": f"step {i}: open the settings panel"})
        msgs.append(jc._chat(core, "s", msgs))
    core.close()
    return (tmp_path / f"t{turns}" / "sessions" / "s.journal").stat().st_size


@pytest.mark.timeout(300)
def test_disk_per_session_grows_linearly_with_turns(tmp_path):
    sizes = {t: _plain_journal(tmp_path, t) for t in (10, 50, 200)}
    # Linear: 5x and 4x the turns cost ~5x and ~4x the bytes (the format 1 journal: ~25x, ~16x).
    assert 4 <= sizes[50] / sizes[10] <= 6.5, sizes
    assert 3.2 <= sizes[200] / sizes[50] <= 5, sizes


class _Ignoring(jc.Engine):
    """An engine that does not know ``routed_experts_start_len``: every row, every turn."""

    def send(self, path: str, payload: bytes, *, deadline: float | None = None):
        request = json.loads(jc.payload_bytes(payload))  # an image turn sends pieces
        request.pop("routed_experts_start_len", None)
        return super().send(path, json.dumps(request).encode(), deadline=deadline)


class _Reference(jc.Engine):
    """The reference backend's own replies (its R3 rows, its ``routed_experts_start_len``)."""

    def send(self, path: str, payload: bytes, *, deadline: float | None = None):
        from webapp.backend import BackendReply, payload_bytes
        payload = payload_bytes(payload)  # an image turn sends pieces
        from webapp.reference_backend import R3Shape, reference_completion_json

        request = json.loads(payload)
        self.sent.append(request)
        return BackendReply.from_raw(reference_completion_json(
            request["input_ids"], jc.TOK, want_r3=True, r3=R3Shape(layers=jc.LAYERS, top_k=jc.TOPK),
            r3_start=request.get("routed_experts_start_len", 0)))


def _run(tmp_path: Path, name: str, engine: jc.Engine, incremental: bool) -> tuple[dict[str, bytes], list]:
    with jc.fixed_clock():
        core = jc.core_on(str(tmp_path / name), engine)
        core.dialect.incremental_replay = incremental  # an instance attribute: this core only
        sids = jc.play(core)
        got = jc.gets(core, sids)
        samples = {sid: core.samples(sid, b"{}").read() for sid in sids}
        core.close()
    return {**got, **{f"{sid}.samples": s for sid, s in samples.items()}}, engine.sent


@pytest.mark.parametrize("engine", [jc.Engine, _Reference])
def test_incremental_routed_experts_assemble_the_same_records_as_full_requests(tmp_path, engine):
    full, full_sent = _run(tmp_path, "full", engine(), incremental=False)
    inc, inc_sent = _run(tmp_path, "inc", engine(), incremental=True)
    assert inc == full  # every records GET (R3 included) and every samples payload
    assert not any("routed_experts_start_len" in r for r in full_sent)
    starts = [r.get("routed_experts_start_len") for r in inc_sent]
    assert sum(1 for s in starts if s) >= len(starts) - 5, starts  # all but each session's first turn
    # each incremental request asks for the rows past the previous turn's sequence
    for request in inc_sent:
        if request.get("routed_experts_start_len"):
            assert 0 < request["routed_experts_start_len"] < len(request["input_ids"])
    again = jc.core_on(str(tmp_path / "inc"))
    assert jc.gets(again, ["plain", "image", "rollback", "tools"]) == {
        k: v for k, v in full.items() if not k.endswith(".samples")}  # read back from the journal


def test_an_engine_that_ignores_the_start_sends_every_row_and_the_records_are_the_same(tmp_path):
    full, _ = _run(tmp_path, "full", jc.Engine(), incremental=False)
    ignored, _sent = _run(tmp_path, "ignored", _Ignoring(), incremental=True)
    assert ignored == full


def test_any_byte_range_of_an_assembled_get_is_the_same_bytes(tmp_path):
    """Ranges cut text spans, base64 spans (inside a quantum too) and inline pieces alike."""
    import random

    from webapp.filebody import B64Span, read_pieces, slice_pieces

    with jc.fixed_clock():
        core = jc.core_on(str(tmp_path))
        sids = jc.play(core, turns=3)
    pieces = core.get_session(sids[0]).body
    assert any(isinstance(p, B64Span) for p in pieces)
    whole = read_pieces(pieces)
    json.loads(whole)
    rng = random.Random(7)
    for _ in range(300):
        a = rng.randrange(len(whole))
        b = rng.randrange(a, len(whole) + 1)
        assert read_pieces(slice_pieces(pieces, a, b)) == whole[a:b], (a, b)
