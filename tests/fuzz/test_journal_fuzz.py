"""Fuzz journal recovery: generated damage (flipped bytes anywhere, zeroed ranges, cuts, spliced
garbage) to real journals, then a restart of the session core on the same data directory.

Whatever the damage, recovery never raises, never deletes bytes (the live file plus its
sidecars hold at least every byte the damaged file held, and only a file shorter than its
header is removed), serves only records that are a prefix of what was served before the damage
(byte for byte), lets the session continue, and a second restart finds nothing more to set
aside. Seeded (``SHINKEN_FUZZ_SEED``), bounded in time; every file is under ``tmp_path``.
"""

from __future__ import annotations

import os
import random
import shutil
import time

import pytest

from tests.webapp.test_core import body_of, new_session
from tests.webapp.test_journal import core_on, play
from webapp.journal import SIDECAR, SUFFIX

pytestmark = pytest.mark.fuzz

SEED = int(os.environ.get("SHINKEN_FUZZ_SEED", "32"))
CASES = 150
TIME_BOUND = 60.0  # seconds for all cases on a loaded 2-core machine


def _records(body: bytes) -> bytes:
    return body[:body.rindex(b'],"metadata":')]


def _damage(rng: random.Random, data: bytearray) -> str:
    kind = rng.choice(["flip", "flip", "flips", "zeros", "cut", "splice"])
    at = rng.randrange(len(data))
    if kind == "flip":
        data[at] ^= 1 << rng.randrange(8)
    elif kind == "flips":
        for _ in range(rng.randrange(2, 6)):
            data[rng.randrange(len(data))] ^= 0xFF
    elif kind == "zeros":
        n = rng.randrange(1, 300)
        data[at:at + n] = bytes(len(data[at:at + n]))
    elif kind == "cut":
        del data[at:]
    else:
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
    return f"{kind}@{at}"


@pytest.mark.timeout(300)
def test_generated_journal_damage_never_loses_bytes_or_serves_unverified_records(tmp_path) -> None:
    rng = random.Random(SEED)
    pristine = tmp_path / "pristine"
    core = core_on(pristine)
    sid = new_session(core)
    msgs = play(core, sid, 5)
    served = _records(core.get_session(sid).read())
    core.close()
    original = (pristine / "sessions" / f"{sid}{SUFFIX}").read_bytes()
    started = time.monotonic()
    for case in range(CASES):
        data_dir = tmp_path / f"case{case}"
        shutil.copytree(pristine, data_dir)
        path = data_dir / "sessions" / f"{sid}{SUFFIX}"
        data = bytearray(original)
        what = _damage(rng, data)
        path.write_bytes(data)
        again = core_on(data_dir)  # must not raise, whatever the damage
        sidecars = sorted((data_dir / "sessions").glob(f"{sid}{SUFFIX}{SIDECAR}*"))
        kept = (path.stat().st_size if path.exists() else 0) + sum(p.stat().st_size for p in sidecars)
        if len(data) > 8:
            assert kept >= len(data), (case, what, kept, len(data))
        reply = again.get_session(sid)
        if reply.status == 200:
            got = _records(reply.read())
            # a prefix of the records served before, byte for byte (a rewritten CREATE keeps them all)
            assert served.startswith(got) and (got == served or got.endswith(b"[")
                                           or served[len(got):len(got) + 1] == b","), \
                (case, what)
            n = len(body_of(reply)["records"])
            play(again, sid, 1, msgs[:2 * n])  # the session continues from what it holds
        else:
            assert reply.status == 404, (case, what, reply.status)
        again.close()
        before = sorted(p.name for p in (data_dir / "sessions").iterdir())
        core_on(data_dir).close()
        assert sorted(p.name for p in (data_dir / "sessions").iterdir()) == before, (case, what)
        shutil.rmtree(data_dir)
        assert time.monotonic() - started < TIME_BOUND, f"only {case} cases in {TIME_BOUND} s"
