"""Small helpers shared by test modules (importable as ``tests.support``)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from bench import procfs

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where ``tests`` is a package
# A server's graceful stop may take gunicorn's graceful_timeout (20 s) plus the launcher's cleanup.
GRACEFUL_STOP_TIMEOUT = 30.0
EXIT_GRACE = 5.0  # what a graceful stop left may take this long to finish exiting


def start_hub_ticker(period: float) -> tuple[list[int], Any]:
    """In a gevent-patched script: a greenlet appending to the returned list every ``period``
    seconds (and the greenlet, to kill), so the script can tell whether the hub kept running
    while something else blocked."""
    import gevent

    ticks: list[int] = []

    def tick() -> None:
        while True:
            ticks.append(1)
            gevent.sleep(period)

    return ticks, gevent.spawn(tick)


def wait_for(probe: Callable[[], bool], timeout: float, period: float = 0.05) -> bool:
    """Poll ``probe`` every ``period`` seconds until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            return False
        time.sleep(period)
    return True


def native_thread_count(settle_to: int | None = None) -> int:
    """Threads of this process; with ``settle_to``, give exiting threads up to
    5 s to be reaped by the OS (a joined thread may linger for a moment)."""
    deadline = time.monotonic() + 5
    count = procfs.thread_count()
    while settle_to is not None and count != settle_to and time.monotonic() < deadline:
        time.sleep(0.01)
        count = procfs.thread_count()
    return count


def run_script(source: str, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Run ``source`` in a fresh interpreter where any warning is an error; it may import
    ``tests.support`` whatever the current directory."""
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, _REPO]) if path else _REPO)
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(source), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


def clean_stdout(result: subprocess.CompletedProcess[str]) -> str:
    """Stdout of a script that must exit 0 and print nothing on stderr (where any
    warning is an error, so an empty stderr means no leak, no unawaited coroutine)."""
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    return result.stdout


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_process(argv: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` for a process a test will interrupt (SIGINT): SIGINT is reset to its
    default in the child. A non-interactive shell starts background jobs (``tox &``) with SIGINT
    ignored, every descendant inherits that across exec, and a Ctrl-C test would then interrupt
    nothing."""
    return subprocess.Popen(argv, preexec_fn=_default_sigint, **popen_kwargs)  # noqa: PLW1509


def sigint_ignored(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (its ``SigIgn`` mask in /proc)."""
    mask = int(procfs.status(pid)["SigIgn"], 16)
    return bool(mask & (1 << (signal.SIGINT - 1)))


def _alive(procs: list) -> list[str]:
    import psutil

    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return alive


def sigkill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process below it at once, then reap it. Its tree, not its
    process group: a session server's gunicorn and reference backend run in sessions of their
    own (a terminal's Ctrl-C reaches only the launcher)."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    proc.wait(30)


def sigkill_and_expect_no_descendant(proc: subprocess.Popen, expected: tuple[str, ...], min_descendants: int,
                                     bound_s: float = 45.0) -> None:
    """SIGKILL ``proc`` (no ``finally`` of its runs) and assert that every process below it is
    gone within ``bound_s``. Before the kill, its descendants must number at least
    ``min_descendants`` and their command lines contain each of ``expected`` (so the check sees
    the whole tree). Whatever survives is SIGKILLed afterwards, so a failure leaks nothing."""
    import psutil

    tree = psutil.Process(proc.pid).children(recursive=True)
    try:
        cmdlines = " | ".join(" ".join(p.cmdline()) for p in tree)
        for part in expected:
            assert part in cmdlines, cmdlines
        assert len(tree) >= min_descendants, cmdlines
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + bound_s
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(tree), _alive(tree)
    finally:
        for leftover in tree:
            try:
                leftover.kill()
            except psutil.NoSuchProcess:
                pass


class ServerProcess:
    """A server subprocess whose merged stdout/stderr is drained by a reader thread.

    It leads a process group of its own, so :meth:`close` can kill whatever its tree leaves
    behind (gunicorn has no parent-death signal).
    """

    def __init__(self, argv: list[str], env: dict[str, str], ready_pattern: str, timeout: float) -> None:
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.leftovers: list[psutil.Process] = []
        self._lines: list[str] = []
        self._ready = threading.Event()
        self._pattern = re.compile(ready_pattern)
        self.url = ""
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._ready.wait(timeout) or not self.url:
            self.close()
            raise RuntimeError(f"server not ready after {timeout} s:\n{self.output()}")

    def _drain(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            self._lines.append(line)
            match = self._pattern.search(line)
            if match and not self.url:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()  # EOF: the process died before it was ready

    def output(self) -> str:
        return "".join(self._lines)

    def close(self, timeout: float = GRACEFUL_STOP_TIMEOUT) -> None:
        """SIGTERM (a graceful stop of the whole tree), then SIGKILL to the process group.

        ``leftovers``: the descendants still alive after the graceful stop, before the SIGKILL.
        """
        if self.proc.poll() is None:
            try:
                tree = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                tree = []
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
                _gone, self.leftovers = psutil.wait_procs(tree, timeout=EXIT_GRACE)
            except subprocess.TimeoutExpired:
                self.leftovers = [p for p in tree if p.is_running()]
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the whole group is gone already
            pass
        self.proc.wait(timeout)
