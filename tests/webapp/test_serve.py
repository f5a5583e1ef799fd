"""``shinken-session-server`` as a process tree: it dies whole with its parent, and usage
errors are one line with exit code 2."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import psutil
import pytest

from webapp.serve import READY_URL_PATTERN, server_argv

pytestmark = pytest.mark.integration


def _alive(procs: list[psutil.Process]) -> list[str]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [2, 0])
def test_sigkill_of_the_server_takes_its_whole_tree(workers):
    """gunicorn, its worker, the session workers and the embedded reference backend all go when
    webapp.serve is SIGKILLed (no finally runs): they used to live on under PID 1."""
    proc = subprocess.Popen(server_argv(workers), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        line = proc.stdout.readline()
        assert re.search(READY_URL_PATTERN, line), line
        tree = psutil.Process(proc.pid).children(recursive=True)
        cmdlines = " | ".join(" ".join(p.cmdline()) for p in tree)
        assert "gunicorn" in cmdlines and "webapp.reference_backend" in cmdlines, cmdlines
        assert len(tree) >= 3 + workers, cmdlines  # backend, gunicorn master + worker, session workers
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 45
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(tree), _alive(tree)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        for leftover in tree:
            try:
                leftover.kill()
            except psutil.NoSuchProcess:
                pass


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
