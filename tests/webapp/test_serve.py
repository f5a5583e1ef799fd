"""``shinken-session-server`` as a process tree: it dies whole with its parent, and usage
errors are one line with exit code 2."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import psutil
import pytest
import requests

from tests.support import sigkill_and_expect_no_descendant
from webapp.serve import (
    READY_URL_PATTERN,
    SessionServerNotReady,
    server_argv,
    start_session_server,
)

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [2, 0])
def test_sigkill_of_the_server_takes_its_whole_tree(workers):
    """gunicorn, its worker, the session workers and the embedded reference backend all go when
    webapp.serve is SIGKILLed (no finally runs): they used to live on under PID 1."""
    proc = subprocess.Popen(server_argv(workers), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert re.search(READY_URL_PATTERN, line), line
        # backend, gunicorn master + worker, session workers
        sigkill_and_expect_no_descendant(proc, ("gunicorn", "webapp.reference_backend"), 3 + workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "webapp.serve", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_a_taken_port_is_one_line_and_exit_code_2():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _serve("--bind", f"127.0.0.1:{port}")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"127.0.0.1:{port}" in line and "--bind" in line and "Traceback" not in result.stderr, line
    assert result.stdout == ""  # nothing started, so no ready line either


@pytest.mark.parametrize(("args", "names"), [
    (["--workers", "-1"], ["--workers", "-1", ">= 0"]),
    (["--workers", "two"], ["--workers", "'two'", "whole number"]),
    (["--bind", "127.0.0.1:99999"], ["--bind", "99999"]),
])
def test_bad_arguments_are_one_line_and_exit_code_2(args, names):
    result = _serve(*args)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    for name in names:
        assert name in line, line


def test_start_session_server_binds_port_0_itself_and_reports_the_url(reference_backend_factory, tmp_path) -> None:
    backend = reference_backend_factory()
    log = tmp_path / "server.log"
    with start_session_server(1, backend.url, "127.0.0.1:0", log_path=log) as server:
        assert server.url.startswith("http://127.0.0.1:") and not server.url.endswith(":0")
        assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
        assert requests.post(f"{server.url}/sessions", timeout=30).status_code == 200
        pid = server.pid
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert log.stat().st_size > 0  # gunicorn's own output went to the log


def test_start_session_server_says_why_it_is_not_ready(reference_backend_factory, tmp_path) -> None:
    backend = reference_backend_factory()
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(SessionServerNotReady) as exc:
        start_session_server(1, backend.url, "127.0.0.1:0", "--tokenizer", str(missing),
                             log_path=tmp_path / "server.log")
    # Checked by the launcher before anything starts: a usage error, one line (not a shard that
    # could not boot, with a traceback per worker).
    assert exc.value.exit_code == 2 and "is not a directory" in exc.value.detail
    assert str(missing) in str(exc.value) and "Traceback" not in exc.value.detail


@pytest.mark.timeout(120)
def test_an_ephemeral_port_without_data_dir_keeps_its_journals_in_a_directory_removed_at_exit(tmp_path):
    """``--bind HOST:0`` and no ``--data-dir``: no per-port folder is left under the state dir."""
    import json
    import os
    import signal

    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "XDG_STATE_HOME": str(tmp_path / "state")}
    (tmp_path / "tmp").mkdir()
    proc = subprocess.Popen(server_argv(1), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    try:
        ready = json.loads(proc.stdout.readline())
        data_dir = ready["data_dir"]
        assert ready["data_dir_removed_at_exit"] and data_dir.startswith(str(tmp_path / "tmp")), ready
        sid = requests.post(f"{ready['url']}/sessions", timeout=30).json()["session_id"]
        chat = requests.post(f"{ready['url']}/sessions/{sid}/v1/chat/completions", timeout=60,
                             json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text[:300]
        assert os.path.exists(os.path.join(data_dir, "sessions", f"{sid}.journal"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not os.path.exists(data_dir)
        assert not (tmp_path / "state").exists()  # nothing under the user's state directory
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
