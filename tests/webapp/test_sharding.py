"""Sharding: deterministic, spread, and the same in every process whatever PYTHONHASHSEED."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from webapp.sharding import mint_session_id, shard_for

IDS = [f"{i:032x}" for i in range(200)] + ["", "ünïcode", "a" * 128]


def test_known_values() -> None:
    # blake2b(..., digest_size=8) big-endian, computed independently of the module
    for sid in ("abc", "0" * 32, "ünïcode"):
        expected = int(hashlib.blake2b(sid.encode(), digest_size=8).hexdigest(), 16)
        assert shard_for(sid, 7) == expected % 7
        assert shard_for(sid, 2**64 + 1) == expected
    assert shard_for("abc", 1) == 0


def test_deterministic_and_in_range() -> None:
    for n in (1, 2, 3, 8):
        shards = [shard_for(sid, n) for sid in IDS]
        assert shards == [shard_for(sid, n) for sid in IDS]
        assert all(0 <= s < n for s in shards)


def test_spread_over_minted_ids() -> None:
    counts = Counter(shard_for(mint_session_id(), 4) for _ in range(4000))
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 700  # ~1000 each; a broken hash piles onto few shards


@pytest.mark.parametrize("n", [0, -1])
def test_fewer_than_one_shard_is_an_error(n: int) -> None:
    with pytest.raises(ValueError):
        shard_for("abc", n)


def test_minted_ids_are_uuid4_hex() -> None:
    ids = {mint_session_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 32 and int(i, 16) >= 0 and i == i.lower() for i in ids)


@pytest.mark.integration
def test_stable_across_processes_and_hash_seeds() -> None:
    script = ("import json, sys; from webapp.sharding import shard_for; "
              "print(json.dumps([shard_for(s, 5) for s in json.loads(sys.stdin.read())]))")
    results = []
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", script], input=json.dumps(IDS), env=env,
                             capture_output=True, text=True, check=True, timeout=60)
        results.append(json.loads(out.stdout))
    assert all(r == [shard_for(s, 5) for s in IDS] for r in results)
