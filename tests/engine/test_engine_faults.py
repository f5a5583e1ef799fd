"""Failures against a real vLLM (CPU build): start-up checks and an engine that dies mid-session.

- Start-up: an engine of another kind than configured, and a tokenizer whose vocabulary is not
  the engine's, each fail the start within seconds with one line naming the problem (not a
  120 s wait and not a traceback).
- Run time, both server modes: the engine is killed (SIGKILL, its whole process group) in the
  middle of a session: the next turn answers 502 naming the backend problem and records
  nothing; once the engine is back (restarted on the same port), the same session continues
  and its records are the engine's own (token-exact, as in test_vllm.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from tests.engine.engine import ENGINE_TEST_TIMEOUT, Engine
from tests.engine.models import build_other_vocab_tokenizer, build_qwen2
from tests.engine.turns import HISTORY, TOOLS, assert_record_is_the_engines, new_session, output_ids, records
from webapp.serve import SessionServerNotReady, start_session_server

# A test's timeout covers its fixtures' setup: the first test of a module waits for an engine start.
pytestmark = [pytest.mark.engine, pytest.mark.integration, pytest.mark.timeout(ENGINE_TEST_TIMEOUT)]

FAIL_WITHIN_S = 15.0  # "within seconds": the checks are a few loopback HTTP calls


@pytest.fixture(scope="module")
def engine(models_dir: Path, engine_factory) -> Engine:
    return engine_factory(build_qwen2(models_dir / "faults-qwen2"))


def _start_fails(tmp_path: Path, *flags: str) -> tuple[SessionServerNotReady, float]:
    t0 = time.monotonic()
    with pytest.raises(SessionServerNotReady) as info:
        start_session_server(0, None, "127.0.0.1:0", *flags, log_path=tmp_path / "server.log").close()
    return info.value, time.monotonic() - t0


def test_an_engine_of_another_kind_fails_the_start_in_one_line(engine, tmp_path):
    err, took = _start_fails(tmp_path, "--backend-url", engine.url, "--tokenizer", str(engine.model_dir),
                             "--backend-kind", "sglang")
    assert took < FAIL_WITHIN_S
    assert "\n" not in err.detail and "--backend-kind sglang" in err.detail and "vllm" in err.detail, err.detail


def test_a_tokenizer_of_another_vocabulary_fails_the_start_in_one_line(engine, tmp_path):
    other = tmp_path / "other-tokenizer"
    build_other_vocab_tokenizer(other)
    for kind in ("vllm", "auto"):
        err, took = _start_fails(tmp_path, "--backend-url", engine.url, "--tokenizer", str(other),
                                 "--backend-kind", kind)
        assert took < FAIL_WITHIN_S
        assert "\n" not in err.detail and "tokenizer" in err.detail and "not the engine's" in err.detail, err.detail


def test_auto_finds_vllm_and_the_right_tokenizer_passes(engine, tmp_path):
    with start_session_server(0, engine.url, "127.0.0.1:0", "--tokenizer", str(engine.model_dir),
                              log_path=tmp_path / "server.log") as server:
        sid = new_session(server.url)
        resp = requests.post(f"{server.url}/sessions/{sid}/v1/chat/completions", timeout=60,
                             json={"model": "m", "messages": HISTORY, "tools": TOOLS, "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        assert records(server.url, sid)["records"][0]["request"]["engine"]["kind"] == "vllm"
    assert "speaking vllm" in (tmp_path / "server.log").read_text()


def test_an_engine_killed_mid_session_is_502_then_the_session_continues(engine, tmp_path):
    """Both server modes at once (two servers, one engine): one kill and one restart."""
    servers = [start_session_server(workers, engine.url, "127.0.0.1:0", "--tokenizer", str(engine.model_dir),
                                    "--backend-kind", "vllm", log_path=tmp_path / f"server-{workers}.log")
               for workers in (0, 2)]
    try:
        sessions = []
        for server in servers:
            sid = new_session(server.url)
            msgs = list(HISTORY)
            resp = requests.post(f"{server.url}/sessions/{sid}/v1/chat/completions", timeout=60,
                                 json={"model": "m", "messages": msgs, "tools": TOOLS, "seed": 1, "max_tokens": 6})
            assert resp.status_code == 200, resp.text
            msgs += [resp.json()["choices"][0]["message"], {"role": "tool", "tool_call_id": "c0", "content": "ok"}]
            sessions.append((server.url, sid, msgs))
        engine.kill()
        for base, sid, msgs in sessions:
            t0 = time.monotonic()
            resp = requests.post(f"{base}/sessions/{sid}/v1/chat/completions", timeout=60,
                                 json={"model": "m", "messages": msgs, "tools": TOOLS, "seed": 2, "max_tokens": 6})
            assert resp.status_code == 502, resp.text
            assert "unreachable" in resp.text, resp.text  # the dialect's reason, not a bare 502
            assert time.monotonic() - t0 < FAIL_WITHIN_S
            assert len(records(base, sid)["records"]) == 1  # the failed turn recorded nothing
        engine.start()
        for base, sid, msgs in sessions:
            resp = requests.post(f"{base}/sessions/{sid}/v1/chat/completions", timeout=120,
                                 json={"model": "m", "messages": msgs, "tools": TOOLS, "seed": 2, "max_tokens": 6})
            assert resp.status_code == 200, resp.text
            recs = records(base, sid)["records"]
            assert len(recs) == 2
            first, second = (r["request"]["input_ids"] for r in recs)
            out = output_ids(recs[0])
            assert second[:len(first) + len(out)] == first + out  # the same session, append-only
            assert_record_is_the_engines(engine, recs[1], {"seed": 2, "max_tokens": 6})
    finally:
        for server in servers:
            server.close()
