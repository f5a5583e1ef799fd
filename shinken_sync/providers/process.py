"""Starting, probing and stopping shinkend child processes on loopback.

:func:`start_daemons` launches ``sys.executable -m shinken_sync.daemon.server``
children with bounded parallelism and waits for each one's ready line. Every
child gets a fresh random token through a pipe it reads to EOF at start
(``--token-fd``: the token is in no file, argument or environment variable,
so nothing in ``/proc/PID/{cmdline,environ}`` names it), and its stderr goes to an
already-unlinked temporary file whose descriptor the parent keeps, so a failed
start can quote the daemon's last words and a crash leaves nothing on disk.

Children die with their parent three ways:

* ``PR_SET_PDEATHSIG`` (SIGTERM) is set in the child before exec. The kernel
  sends it when the *thread* that forked exits, so every child is forked from
  one long-lived spawner thread owned by this module, never from a caller's
  short-lived thread;
* :meth:`DaemonProcess.terminate` from ``Provider.close()`` / ``destroy()``;
* an ``atexit`` hook terminating whatever is still running (Ctrl-C included:
  KeyboardInterrupt unwinds through it).

Children run in their own session, so a terminal's Ctrl-C reaches only the
parent: it decides when its sandboxes stop (``shinken demo`` lets the turns in
flight finish first), instead of every daemon vanishing under a running call.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import IO, Any

from shinken_sync.childproc import ReadyLineBuffer, ReadyLineTooLong, StdoutClosed, parse_ready_line
from shinken_sync.lifetime import parent_death_preexec
from shinken_sync.native import close_now

from .base import Liveness
from .errors import DaemonStartError

#: How long a daemon may take from exec to its ready line.
DEFAULT_START_TIMEOUT_S = 30.0
#: SIGTERM -> SIGKILL escalation delay (a clean stop includes stopping Xvfb).
TERMINATE_TIMEOUT_S = 10.0
#: Bytes of a daemon's stderr quoted in a DaemonStartError.
STDERR_TAIL_BYTES = 4000

_live: weakref.WeakSet[DaemonProcess] = weakref.WeakSet()
_spawner_lock = threading.Lock()
_spawner: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None

def memory_cgroup_oom_counter(pid: int | str = "self") -> str | None:
    """The file holding ``oom_kill`` for ``pid``'s memory cgroup, or None.

    cgroup v2: ``memory.events``; v1: ``memory.oom_control`` (Linux >= 4.13).
    """
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            candidate = f"/sys/fs/cgroup/memory{path}/memory.oom_control"
        elif controllers == "":
            candidate = f"/sys/fs/cgroup{path}/memory.events"
        else:
            continue
        if os.path.exists(candidate):
            return candidate
    return None


def read_oom_kills(counter: str | None) -> int | None:
    """The ``oom_kill`` count in ``counter`` (see :func:`memory_cgroup_oom_counter`), or None."""
    if counter is None:
        return None
    try:
        with open(counter) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def _spawn_thread() -> concurrent.futures.ThreadPoolExecutor:
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():  # first use, or a forked child
            _spawner = (os.getpid(), concurrent.futures.ThreadPoolExecutor(1, "shinken-spawner"))
        return _spawner[1]


class DaemonProcess:
    """One shinkend child: its process, token and ready line.

    Subclasses change how the daemon is launched through the hooks
    :meth:`_prepare` (before the spawn), :meth:`_command`, :meth:`_popen` (in
    the spawner thread), :meth:`_spawned` (right after) and :meth:`_abandon`
    (a failed start); :mod:`.isolated` runs it inside a bubblewrap sandbox.
    """

    def __init__(self, argv: list[str], name: str):
        self.name = name
        self.token = secrets.token_urlsafe(32)
        self._token_fd: int | None = None  # the child's end of the token pipe, until the spawn
        self._stderr: IO[bytes] = tempfile.TemporaryFile(prefix="shinkend-stderr-")  # noqa: SIM115 (kept open)
        self.ready: dict[str, Any] = {}
        self._stdout = ReadyLineBuffer()
        self._oom_counter: str | None = None
        self._oom_kills_at_start: int | None = None
        try:
            self._prepare()
            cmd = self._command(argv)
            self.process: subprocess.Popen[bytes] = _spawn_thread().submit(self._popen, cmd).result()
            self._spawned()
        except BaseException:
            self._abandon()
            raise
        _live.add(self)

    def _prepare(self) -> None:
        self._token_fd, write_end = os.pipe()
        try:
            os.write(write_end, self.token.encode())  # 43 bytes: far below a pipe's buffer, never blocks
        finally:
            # The child reads the token to EOF: under gevent, os.close would leave this end open
            # until the hub next wakes, and the start would wait on the ready line meanwhile.
            close_now(write_end)

    def _command(self, argv: list[str]) -> list[str]:
        return [sys.executable, "-m", "shinken_sync.daemon.server", "--token-fd", str(self._token_fd), *argv]

    def _pass_fds(self) -> list[int]:
        """Descriptors the child inherits (at their numbers)."""
        return [] if self._token_fd is None else [self._token_fd]

    def _preexec(self) -> Callable[[], None]:
        """What the child runs before exec: system calls only (one spawner thread; see docstring)."""
        return parent_death_preexec(signal.SIGTERM)

    def _popen(self, cmd: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            close_fds=True,
            pass_fds=self._pass_fds(),
            start_new_session=True,
            preexec_fn=self._preexec(),  # noqa: PLW1509 (one spawner thread; see docstring)
        )

    def _spawned(self) -> None:
        self._forget_token()  # the child holds its end now
        # The kernel counts OOM kills per memory cgroup; the child starts in ours.
        self._oom_counter = memory_cgroup_oom_counter(self.process.pid)
        self._oom_kills_at_start = read_oom_kills(self._oom_counter)

    def _abandon(self) -> None:
        """Undo a start that failed before the daemon was tracked."""
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(TERMINATE_TIMEOUT_S)
        if process is not None and process.stdout is not None:
            process.stdout.close()
        self._forget_token()
        self._stderr.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        url: str = self.ready["url"]  # the ready line's JSON, checked to hold a url
        return url

    @property
    def _stdout_pipe(self) -> IO[bytes]:
        stdout = self.process.stdout
        assert stdout is not None  # _popen opens it as a PIPE
        return stdout

    # -- startup -------------------------------------------------------------

    def _feed(self) -> bool | None:
        """Read what stdout holds: True once the ready line is complete, False
        at EOF (the daemon exited or closed stdout), None to keep waiting."""
        try:
            line = self._stdout.feed(os.read(self._stdout_pipe.fileno(), 65536))
        except StdoutClosed:
            return False
        except ReadyLineTooLong:
            raise self.start_error("the daemon wrote more than a ready line's worth without a newline") from None
        if line is None:
            return None
        ready = parse_ready_line(line)
        if ready is None or ready.get("event") != "ready" or "url" not in ready:
            raise self.start_error(f"expected a ready line, got {line[:200]!r}")
        self.ready = ready
        return True

    def _started(self) -> None:
        self._stdout_pipe.close()  # the daemon writes nothing else to stdout

    def start_error(self, message: str) -> DaemonStartError:
        self.terminate()
        rc = self.process.returncode
        tail = self.stderr_tail()
        # The daemon's last words (a traceback's last line names the exception) on the first
        # line too: what failed, without reading the whole tail.
        last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
        return DaemonStartError(
            f"shinkend {self.name}: {message}" + (f": {last[:300]}" if last else ""),
            exit_code=rc if rc is not None and rc >= 0 else None,
            signal=-rc if rc is not None and rc < 0 else None,
            stderr_tail=tail,
        )

    def stderr_tail(self, limit: int = STDERR_TAIL_BYTES) -> str:
        try:
            size = os.fstat(self._stderr.fileno()).st_size
            data = os.pread(self._stderr.fileno(), limit, max(0, size - limit))
        except (OSError, ValueError):
            return ""
        return data.decode("utf-8", errors="replace")

    # -- probing and stopping --------------------------------------------------

    def liveness(self) -> Liveness:
        rc = self.process.poll()
        if rc is None:
            return Liveness(alive=True)
        if rc >= 0:
            return Liveness(alive=False, exit_code=rc, detail=f"shinkend exited with code {rc}")
        name = _signal_name(-rc)
        detail = f"shinkend killed by {name}"
        oom = False
        if -rc == signal.SIGKILL:
            # The OOM killer sends SIGKILL too; the exit status cannot tell them
            # apart, but the memory cgroup's oom_kill counter can: it rose while
            # this daemon ran (in a cgroup shared with other processes, an OOM
            # kill of one of them at the same time would read the same).
            before, now = self._oom_kills_at_start, read_oom_kills(self._oom_counter)
            if before is None or now is None:
                detail += " (no readable memory cgroup: an OOM kill would look the same)"
            elif now > before:
                oom = True
                detail += f" by the kernel's OOM killer (the memory cgroup's oom_kill count went {before} -> {now})"
            else:
                detail += " (not an OOM kill: the memory cgroup's oom_kill count did not move)"
        return Liveness(alive=False, signal=-rc, oom=oom, detail=detail)

    def terminate(self, timeout: float = TERMINATE_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; idempotent."""
        proc = self.process
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(TERMINATE_TIMEOUT_S)
        if proc.stdout is not None and not proc.stdout.closed:
            proc.stdout.close()
        self._forget_token()
        _live.discard(self)

    def release(self) -> None:
        """Terminate and close the stderr capture."""
        self.terminate()
        self._stderr.close()

    def _forget_token(self) -> None:
        if self._token_fd is not None:
            with contextlib.suppress(OSError):
                close_now(self._token_fd)
            self._token_fd = None


def start_daemons(
    argvs: list[list[str]],
    names: list[str],
    *,
    parallelism: int = 8,
    timeout: float = DEFAULT_START_TIMEOUT_S,
    spawn: Callable[[list[str], str], DaemonProcess] = DaemonProcess,
) -> list[DaemonProcess]:
    """Start one daemon per argv, at most ``parallelism`` starting at once.

    All or nothing: when one fails to report ready within ``timeout`` seconds,
    every daemon this call started is terminated and :class:`DaemonStartError`
    (with that daemon's stderr tail) is raised.
    """
    if parallelism < 1:
        raise ValueError("parallelism must be >= 1")
    todo = list(zip(argvs, names))
    todo.reverse()
    started: list[DaemonProcess] = []
    deadlines: dict[DaemonProcess, float] = {}
    with selectors.DefaultSelector() as sel:
        try:
            while todo or deadlines:
                while todo and len(deadlines) < parallelism:
                    argv, name = todo.pop()
                    daemon = spawn(argv, name)
                    started.append(daemon)
                    deadlines[daemon] = time.monotonic() + timeout
                    sel.register(daemon._stdout_pipe, selectors.EVENT_READ, daemon)
                wait = max(0.0, min(deadlines.values()) - time.monotonic())
                for key, _ in sel.select(wait):
                    daemon = key.data
                    done = daemon._feed()
                    if done is False:
                        daemon.process.wait(TERMINATE_TIMEOUT_S)
                        raise daemon.start_error("exited before it was ready")
                    if done:
                        sel.unregister(key.fileobj)
                        daemon._started()
                        del deadlines[daemon]
                now = time.monotonic()
                for daemon, deadline in deadlines.items():
                    if now >= deadline:
                        raise daemon.start_error(f"not ready after {timeout:.0f} s")
        except BaseException:
            for daemon in started:
                daemon.release()
            raise
    return started


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@atexit.register
def _terminate_leftovers() -> None:
    for daemon in list(_live):
        with contextlib.suppress(Exception):
            daemon.terminate(timeout=2.0)
