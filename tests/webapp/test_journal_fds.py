"""Journal descriptors kept open between a session's appends (``webapp.journal._OpenJournals``):
one open per session, bounded, per process, closed on delete; the same bytes stored and served
as when every append opened the file."""

from __future__ import annotations

import os
from pathlib import Path

from webapp import journal
from webapp.journal import _OpenJournals

from .test_core import chat, error_of, new_session
from .test_journal import core_on, play


def _opens_of(monkeypatch, directory) -> list[str]:
    opened: list[str] = []
    real = os.open

    def counting(path, *args, **kwargs):
        if str(path).startswith(str(directory)) and str(path).endswith(".journal"):
            opened.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting)
    return opened


def test_a_session_opens_its_journal_once_and_serves_what_a_restart_serves(tmp_path, monkeypatch):
    monkeypatch.setattr(journal, "_open_journals", _OpenJournals(8))
    core = core_on(tmp_path)
    opened = _opens_of(monkeypatch, tmp_path)
    sid = new_session(core)
    play(core, sid, 6)
    # the create's descriptor serves every append (a records GET opens its own, read-only)
    assert opened == [core.registry.store.path(sid)]
    served = core.get_session(sid).read()
    core.close()
    monkeypatch.setattr(journal, "_open_journals", _OpenJournals(8))
    again = core_on(tmp_path)
    assert again.get_session(sid).read() == served


def test_descriptors_are_bounded_and_a_session_past_the_bound_opens_again(tmp_path, monkeypatch):
    cache = _OpenJournals(2)
    monkeypatch.setattr(journal, "_open_journals", cache)
    core = core_on(tmp_path)
    sids = [new_session(core) for _ in range(4)]
    convs = {sid: play(core, sid, 2) for sid in sids}
    assert len(cache) == 2
    for sid in sids:  # each one evicted by the others meanwhile: opened again, same bytes
        convs[sid] = play(core, sid, 2, convs[sid])
        assert len(cache) <= 2
    served = {sid: core.get_session(sid).read() for sid in sids}
    core.close()
    monkeypatch.setattr(journal, "_open_journals", _OpenJournals(0))  # every append opens the file
    again = core_on(tmp_path)
    for sid in sids:
        assert again.get_session(sid).read() == served[sid]
        convs[sid] = play(again, sid, 1, convs[sid])  # and appends as before with nothing kept
    again.close()


def test_delete_closes_the_descriptor_and_the_id_starts_afresh(tmp_path, monkeypatch):
    cache = _OpenJournals(8)
    monkeypatch.setattr(journal, "_open_journals", cache)
    core = core_on(tmp_path)
    sid = new_session(core)
    play(core, sid, 2)
    assert len(cache) == 1
    assert core.delete_session(sid).status == 204
    assert len(cache) == 0
    core.close()


def test_a_journal_deleted_from_outside_is_507_as_when_each_append_opened_it(tmp_path, monkeypatch):
    monkeypatch.setattr(journal, "_open_journals", _OpenJournals(8))
    core = core_on(tmp_path)
    sid = new_session(core)
    msgs = play(core, sid, 2)
    before = core.get_session(sid).read()
    os.unlink(core.registry.store.path(sid))
    reply = chat(core, sid, [*msgs, {"role": "user", "content": "more"}])
    assert reply.status == 507, error_of(reply)
    assert len(journal._open_journals) == 0  # the stale descriptor was dropped
    core.close()
    assert before


def test_a_forked_child_closes_its_inherited_copies_and_opens_its_own(tmp_path):
    cache = _OpenJournals(8)
    path = str(tmp_path / "x.journal")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    cache.give(path, fd)
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's is handed out; its copy closed
        code = 0
        try:
            if cache.take(path) is not None:
                code = 1
            try:
                os.fstat(fd)
                code = 2  # still open in the child
            except OSError:
                pass
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert cache.take(path) == fd  # the parent's is untouched
    os.close(fd)


def test_taking_and_giving_a_descriptor_asks_the_kernel_for_no_process_id(tmp_path, monkeypatch):
    """The fork check reads the process id kept by an ``os.register_at_fork`` hook (the test
    above: a child still sees its own), not a ``getpid`` per take and per give."""
    cache = _OpenJournals(8)
    path = str(tmp_path / "x.journal")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def getpid() -> int:
        raise AssertionError("getpid called on a turn's path")

    monkeypatch.setattr(os, "getpid", getpid)
    cache.give(path, fd)
    assert cache.take(path) == fd
    os.close(fd)


def _field_metas(path) -> list:
    """Each DELTA entry's field metas, read with the documented format."""
    import json
    import struct

    from webapp.journal import ENTRY_HEADER, FILE_HEADER, Kind

    data, out, pos = Path(path).read_bytes(), [], FILE_HEADER.size
    while pos < len(data):
        length, kind, _crc = ENTRY_HEADER.unpack_from(data, pos)
        if kind == Kind.DELTA:
            (n,) = struct.unpack_from("<I", data, pos + ENTRY_HEADER.size)
            at = pos + ENTRY_HEADER.size + 4
            out.append(json.loads(data[at:at + n])["fields"])
        pos += ENTRY_HEADER.size + length
    return out


def test_the_prompt_ids_text_kept_from_the_last_turn_stores_what_computing_it_stores(tmp_path, monkeypatch):
    """A turn's prompt ids are found in its request from the last state's ids text plus the new
    ids; with nothing kept (the cap at -1) every turn computes the whole text: the entries hold
    the same kinds of fields (the ids generated on read in every record) and a restart serves
    the bytes served before it."""
    results = []
    for cap, where in ((1 << 20, tmp_path / "kept"), (-1, tmp_path / "computed")):
        monkeypatch.setattr(journal, "_IDS_TEXT_BYTES", cap)
        core = core_on(where)
        sid = new_session(core)
        msgs = play(core, sid, 4)
        assert chat(core, sid, msgs[:-1]).status == 200  # a rollback: its prompt is a shorter prefix
        assert chat(core, sid, msgs[:-1]).status == 200
        fields = _field_metas(core.registry.store.path(sid))
        served = core.get_session(sid).read()
        core.close()
        again = core_on(where)
        assert again.get_session(sid).read() == served
        again.close()
        assert all(["i"] in f for f in fields)
        results.append([[m[0] for m in f] for f in fields])  # (the ids and times differ per session)
    assert results[0] == results[1]


def test_turns_move_the_shared_byte_total_only_under_a_data_budget(tmp_path, monkeypatch):
    import fcntl

    from webapp.core import SessionCore, SessionRegistry
    from webapp.journal import JournalStore

    from .test_core import R3, TOK, WAIT, FakeBackend

    locks = []
    real = fcntl.flock

    def counting(fd, op):
        locks.append(op)
        return real(fd, op)

    for budget in (None, 1 << 30):
        store = JournalStore(str(tmp_path / str(budget)), max_data_bytes=budget)
        core = SessionCore(TOK, FakeBackend(), registry=SessionRegistry(store), turn_wait_timeout=WAIT,
                           routing_replay_layers=R3.layers)
        sid = new_session(core)
        locks.clear()
        monkeypatch.setattr(fcntl, "flock", counting)
        play(core, sid, 3)
        monkeypatch.setattr(fcntl, "flock", real)
        size = os.path.getsize(store.path(sid))
        sessions, total = store.usage.read()
        if budget is None:
            assert locks == [] and sessions == 1  # no lock per turn; the count still kept
        else:
            assert len(locks) == 2 * 3 and (sessions, total) == (1, size)  # each turn counted under the lock
        core.close()


def test_closing_the_core_closes_its_kept_descriptors_and_a_restore_opens_anew(tmp_path, monkeypatch):
    cache = _OpenJournals(8)
    monkeypatch.setattr(journal, "_open_journals", cache)
    other = core_on(tmp_path / "other")
    play(other, new_session(other), 1)
    core = core_on(tmp_path / "mine")
    sid = new_session(core)
    msgs = play(core, sid, 2)
    assert len(cache) == 2
    again = core_on(tmp_path / "mine")  # a restore of a journal this process holds open
    assert len(cache) == 1
    play(again, sid, 1, msgs)
    core.close()
    again.close()
    assert len(cache) == 1  # the other store's descriptor stays
    other.close()
    assert len(cache) == 0
