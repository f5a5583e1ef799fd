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
