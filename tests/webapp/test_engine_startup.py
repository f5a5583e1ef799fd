"""Start-up checks of the engine behind the session server, and the engine failing at run time,
against real processes on loopback: the launcher (``shinken-session-server``), the reference
backend (SGLang's dialect) and a stand-in answering as vLLM 0.32 does (``vllm_standin``).

Each failure is one line on stderr within seconds (exit 2: a usage error, checked before anything
starts; exit 3: the engine cannot be used as configured), never a traceback or a silent wait.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from webapp.serve import EXIT_NOT_READY, server_argv

from .vllm_standin import VERSION, VllmStandIn

MODES = {"workers0": 0, "router": 2}
QUICK = 20.0  # seconds: a start-up failure must come well before this (the old wait was 120 s)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_launcher(tmp_path: Path, *flags: str, backend_url: str | None = None, workers: int = 0,
                 env: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds) of a launcher expected to fail."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHINKEN_")}
    full_env["SHINKEN_DATA_DIR"] = str(tmp_path / "data")
    full_env.update(env or {})
    started = time.monotonic()
    proc = subprocess.run(server_argv(workers, backend_url, "127.0.0.1:0", *flags), env=full_env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture
def vllm_engine():
    engine = VllmStandIn()
    yield engine
    engine.close()


@pytest.mark.parametrize("url, fragment", [
    ("127.0.0.1:30000", "must start with http:// or https://"),
    ("ftp://127.0.0.1:30000", "must start with http:// or https://"),
    ("http://127.0.0.1:99999", "Port out of range"),
    ("http://127.0.0.1:port", "Port could not be cast"),
    ("http:///v1", "has no host"),
])
def test_a_bad_backend_url_is_one_line_and_exit_2_at_once(tmp_path, url, fragment):
    code, _out, err, took = run_launcher(tmp_path, backend_url=url)
    line = one_line(err)
    assert code == 2 and fragment in line and url in line and took < QUICK


@pytest.mark.parametrize("workers", [0, 2])
def test_an_unreachable_engine_is_one_line_within_seconds(tmp_path, workers):
    url = f"http://127.0.0.1:{closed_port()}"
    code, out, err, took = run_launcher(tmp_path, backend_url=url, workers=workers)
    line = one_line(err)
    assert code == EXIT_NOT_READY and took < QUICK, (took, err)
    assert line.endswith(f"backend {url} unreachable: [Errno 111] Connection refused"), line
    assert json.loads(out.strip().splitlines()[-1]) == {"ready": False, "error": line.split("error: ", 1)[1]}


def test_a_vllm_engine_configured_as_sglang_is_named(tmp_path, vllm_engine):
    code, _out, err, took = run_launcher(tmp_path, "--backend-kind", "sglang", backend_url=vllm_engine.url)
    line = one_line(err)
    assert code == EXIT_NOT_READY and took < QUICK
    assert f"is vllm {VERSION}" in line and "pass --backend-kind vllm" in line


def test_an_sglang_engine_configured_as_vllm_is_named(tmp_path, backend):
    code, _out, err, _took = run_launcher(tmp_path, "--backend-kind", "vllm", backend_url=backend.url)
    line = one_line(err)
    assert code == EXIT_NOT_READY and "is sglang" in line and "pass --backend-kind sglang" in line


def test_a_tokenizer_that_is_not_the_engines_is_named(tmp_path, vllm_engine):
    vllm_engine.tokenize_shift = 1  # the engine's ids for the probe text differ from ours
    code, _out, err, took = run_launcher(tmp_path, backend_url=vllm_engine.url)
    line = one_line(err)
    assert code == EXIT_NOT_READY and took < QUICK
    assert "is not the engine's" in line and "--tokenizer" in line


def test_an_engine_that_accepts_but_does_not_answer_is_waited_for_and_said(tmp_path, vllm_engine):
    vllm_engine.silent = True  # as vLLM while it loads: the port is open, nothing answers
    code, _out, err, took = run_launcher(tmp_path, "--backend-wait", "4", backend_url=vllm_engine.url)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == EXIT_NOT_READY and len(lines) == 2 and "Traceback" not in err, err
    assert "waiting up to 4 s for the engine" in lines[0] and "does not answer yet" in lines[0]
    assert "answered nothing in 4 s" in lines[1] and "--backend-wait" in lines[1]
    assert took < QUICK


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("with_url", [False, True], ids=["embedded", "backend-url"])
def test_a_missing_tokenizer_is_one_line(tmp_path, vllm_engine, workers, with_url):
    code, _out, err, took = run_launcher(tmp_path, "--tokenizer", "/nonexistent/qwen", workers=workers,
                                         backend_url=vllm_engine.url if with_url else None)
    line = one_line(err)
    assert code == 2 and "/nonexistent/qwen" in line and "not a directory" in line and took < QUICK


def test_a_tokenizer_folder_without_the_tokenizers_package_names_the_extra(tmp_path, vl_tokenizer_dir):
    shadow = tmp_path / "shadow" / "tokenizers"
    shadow.mkdir(parents=True)  # an installation without the package, as a fresh pip install -e . has
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'tokenizers'\", "
                                        "name='tokenizers')\n")
    code, _out, err, _took = run_launcher(tmp_path, "--tokenizer", vl_tokenizer_dir,
                                          env={"PYTHONPATH": str(shadow.parent)})
    line = one_line(err)
    assert code == 2 and "'tokenizers' package" in line and "shinken[hf]" in line


@pytest.mark.parametrize("mode", sorted(MODES))
def test_auto_identifies_each_engine_and_says_it(mode, backend, vllm_engine, session_server_factory):
    sglang = session_server_factory.launch(MODES[mode], backend.url)  # --backend-kind auto: the default
    assert f"backend {backend.url}: sglang reference serving shinken-reference; speaking sglang" in sglang.output()
    vllm = session_server_factory.launch(MODES[mode], vllm_engine.url)
    assert f"backend {vllm_engine.url}: vllm {VERSION} serving /tmp/standin/qwen2; speaking vllm" in vllm.output()
    sid = requests.post(f"{vllm.url}/sessions", timeout=30).json()["session_id"]
    resp = requests.post(f"{vllm.url}/sessions/{sid}/v1/chat/completions", timeout=60, stream=True,
                         json={"messages": [{"role": "user", "content": "hi"}], "stream": True,
                               "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in resp.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert resp.status_code == 200 and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["usage"]["prompt_tokens"] == len(vllm_engine.requests[-1]["prompt"])
    assert vllm_engine.requests[-1]["return_token_ids"] is True


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_engine_that_dies_is_502_with_the_reason_and_the_session_resumes(mode, session_server_factory):
    engine = VllmStandIn()
    port = engine.port
    server = session_server_factory.launch(MODES[mode], engine.url, "--backend-kind", "vllm")
    sid = requests.post(f"{server.url}/sessions", timeout=30).json()["session_id"]
    messages = [{"role": "user", "content": "first"}]
    first = requests.post(f"{server.url}/sessions/{sid}/v1/chat/completions", json={"messages": messages}, timeout=60)
    assert first.status_code == 200, first.text
    engine.close()
    messages = [*messages, first.json()["choices"][0]["message"], {"role": "user", "content": "second"}]
    down = requests.post(f"{server.url}/sessions/{sid}/v1/chat/completions", json={"messages": messages}, timeout=60)
    error = down.json()["error"]
    assert down.status_code == 502 and error["code"] == "backend_unreachable"
    assert error["message"].startswith(f"vllm engine at http://127.0.0.1:{port} unreachable")
    engine = VllmStandIn(port)  # back on the same address
    try:
        again = requests.post(f"{server.url}/sessions/{sid}/v1/chat/completions", json={"messages": messages},
                              timeout=60)
        assert again.status_code == 200, again.text
        records = requests.get(f"{server.url}/sessions/{sid}", timeout=30).json()["records"]
        assert len(records) == 2  # the failed turn left nothing
    finally:
        engine.close()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_reply_without_token_ids_is_502_naming_the_field_and_records_nothing(mode, vllm_engine,
                                                                                session_server_factory):
    server = session_server_factory.launch(MODES[mode], vllm_engine.url, "--backend-kind", "vllm")
    vllm_engine.drop_fields = ("token_ids",)  # as vLLM answers without return_token_ids
    sid = requests.post(f"{server.url}/sessions", timeout=30).json()["session_id"]
    resp = requests.post(f"{server.url}/sessions/{sid}/v1/chat/completions", timeout=60,
                         json={"messages": [{"role": "user", "content": "hi"}]})
    error = resp.json()["error"]
    assert resp.status_code == 502 and error["code"] == "backend_malformed"
    assert "choices[0].token_ids" in error["message"]
    assert requests.get(f"{server.url}/sessions/{sid}", timeout=30).json()["records"] == []


