"""The sandbox's shell and file verbs: ``exec``, ``read_file``, ``write_file``.

``exec`` runs ``/bin/sh -c CMD`` in a new session (its own process group), so a
timeout kills the whole group, grandchildren included. Output is captured up to
a per-stream cap; past the cap it is read and discarded (the child never blocks
on a full pipe) and the reply says ``stdout_truncated``. A command that leaves a
background process holding its stdout is not waited for beyond
:data:`DRAIN_GRACE_S` after the shell exits. The cap bounds the *encoded*
reply too: as JSON text, a NUL byte takes 6 bytes (``\u0000``) and an invalid
UTF-8 byte 3 (U+FFFD), so each stream's text is also cut to
:data:`MAX_ENCODED_OUTPUT` bytes of JSON.

File contents travel base64-encoded inside the JSON reply: files are not the
image hot path, and base64 keeps them binary-safe. The file verbs work on
regular files only, opened with ``O_NONBLOCK`` first: a FIFO or a device would
block a thread forever (or produce endless data), so it is refused.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import signal
import stat
import time
from typing import Any

from shinken_sync.protocol import ERR_FAILED, ERR_NOT_FOUND

from . import identity
from .deadline import within
from .errors import VerbError, VerbTimeout

log = logging.getLogger("shinkend.shell")

#: How long to keep reading a command's pipes after the shell itself exited.
DRAIN_GRACE_S = 0.5
_CHUNK = 64 * 2**10
#: Bytes one output stream may take in the JSON reply, escapes included: two
#: streams plus the envelope stay under the 16 MiB message limit, and base64 of
#: the largest capture (4 MiB -> 5.3 MiB) always fits.
MAX_ENCODED_OUTPUT = 6 * 2**20


class Shell:
    """Runs commands for one sandbox and remembers their process groups, so
    :meth:`close` leaves nothing behind when the daemon stops."""

    def __init__(self) -> None:
        self._groups: set[int] = set()

    async def exec(self, p: dict[str, Any]) -> dict[str, Any]:
        user = identity.agent()
        argv = ["/bin/sh", "-c", p["cmd"]]
        env = None if p["env"] is None else {**os.environ, **p["env"]}
        options: dict[str, Any] = {}
        cwd = p["cwd"]
        if user is not None:  # an isolated sandbox: the command runs as the agent, never as the daemon
            argv = user.argv(argv)
            env = {**os.environ, **user.environment(), **(p["env"] or {})}
            options = user.popen_options()
            cwd = cwd or user.home
        started = time.monotonic()
        spawn = asyncio.ensure_future(_start(
            argv,
            stdin=asyncio.subprocess.PIPE if p["stdin"] is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
            **options,
        ))
        try:
            proc = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            # The command may already run: asyncio starts the child, then connects its pipes.
            # Cancelled in between (the client went away), asyncio would kill only the shell
            # and the command's own children would live on; so let the start finish here and
            # kill the whole group.
            with contextlib.suppress(Exception):
                started_proc = await spawn
                _kill_group(started_proc.pid)
                await within(_exited(started_proc), 1.0)
            raise
        except FileNotFoundError as exc:
            raise VerbError(f"cannot run command: {exc}", ERR_NOT_FOUND) from None
        except OSError as exc:
            raise VerbError(f"cannot run command: {exc}") from None
        self._groups.add(proc.pid)
        cap = p["max_output"]
        out, err = _Capture(cap), _Capture(cap)
        assert proc.stdout is not None and proc.stderr is not None  # both started as PIPE
        pumps = [
            asyncio.ensure_future(out.pump(proc.stdout)),
            asyncio.ensure_future(err.pump(proc.stderr)),
        ]
        if p["stdin"] is not None:
            assert proc.stdin is not None  # started as PIPE when there is input
            pumps.append(asyncio.ensure_future(_feed(proc.stdin, p["stdin"])))
        timeout_s = p["timeout_ms"] / 1000
        try:
            try:
                await within(_exited(proc), timeout_s)
            except asyncio.TimeoutError:  # noqa: UP041 (not TimeoutError on 3.10)
                _kill_group(proc.pid)
                raise VerbTimeout(
                    f"command still running after {p['timeout_ms']} ms; its process group was killed "
                    f"({out.total} bytes of stdout, {err.total} of stderr discarded)"
                ) from None
            remaining = timeout_s - (time.monotonic() - started)
            await asyncio.wait(pumps, timeout=max(0.0, min(DRAIN_GRACE_S, remaining)))
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            if proc.returncode is None:  # cancelled: the connection went away mid-command
                _kill_group(proc.pid)
                with contextlib.suppress(asyncio.TimeoutError):
                    await within(_exited(proc), 1.0)
            # Background processes the command left may outlive it in the group.
            if proc.returncode is not None and not _group_alive(proc.pid):
                self._groups.discard(proc.pid)
            # Our ends of its pipes: a background process may still hold the others, and the
            # transport would stay open (and complain when collected after its loop closed).
            if proc.returncode is not None:
                _protocol(proc).close()
        rc = proc.returncode
        assert rc is not None  # _exited(proc) returned: the transport has its exit status
        stdout, stdout_cut = _encode(out.data, p["encoding"])
        stderr, stderr_cut = _encode(err.data, p["encoding"])
        return {
            "exit_code": rc if rc >= 0 else None,
            "signal": -rc if rc < 0 else None,
            "stdout": stdout,
            "stderr": stderr,
            "stdout_truncated": out.truncated or stdout_cut,
            "stderr_truncated": err.truncated or stderr_cut,
            "encoding": p["encoding"],
            "duration_ms": round((time.monotonic() - started) * 1000, 1),
        }

    def close(self) -> None:
        """Kill every process group a command started and that is still alive."""
        for pgid in self._groups:
            _kill_group(pgid)
        self._groups.clear()


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Also resolves ``exited`` when the process exits. ``Process.wait()`` on Python 3.11
    returns only once every pipe is closed too (3.12 fixed it): a command leaving a
    background process on its stdout (``sleep 60 &``) would hold the reply that long."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._process_transport = transport

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)

    def close(self) -> None:
        """Close the pipes (the process has exited: nothing else is done to it)."""
        self._process_transport.close()


async def _start(argv: list[str], **options: Any) -> asyncio.subprocess.Process:
    """``asyncio.create_subprocess_exec`` with :class:`_ExitProtocol`."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.subprocess_exec(
        lambda: _ExitProtocol(limit=2**16, loop=loop), *argv, **options
    )
    return asyncio.subprocess.Process(transport, protocol, loop)


def _protocol(proc: asyncio.subprocess.Process) -> _ExitProtocol:
    protocol = proc._protocol  # type: ignore[attr-defined]  # set by _start, ours
    assert isinstance(protocol, _ExitProtocol)
    return protocol


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Until ``proc`` has exited (its pipes may stay open: see :class:`_ExitProtocol`)."""
    await asyncio.shield(_protocol(proc).exited)


class _Capture:
    def __init__(self, cap: int):
        self.cap = cap
        self.data = bytearray()
        self.total = 0

    @property
    def truncated(self) -> bool:
        return self.total > len(self.data)

    async def pump(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(_CHUNK):
            self.total += len(chunk)
            room = self.cap - len(self.data)
            if room > 0:
                self.data += chunk[:room]


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(ConnectionError):
        stdin.write(data)
        await stdin.drain()
    stdin.close()


def _encode(data: bytes | bytearray, encoding: str) -> tuple[str, bool]:
    """The captured bytes as the reply's string, and whether it had to be cut
    to :data:`MAX_ENCODED_OUTPUT` bytes of JSON."""
    if encoding == "base64":
        return base64.b64encode(data).decode("ascii"), False
    text, cut = data.decode("utf-8", errors="replace"), False
    size = _json_size(text)
    while size > MAX_ENCODED_OUTPUT:
        # Shrink by the measured inflation; each pass is strictly shorter, and
        # one or two passes suffice unless escapes cluster at the start.
        text, cut = text[: len(text) * MAX_ENCODED_OUTPUT // size], True
        size = _json_size(text)
    return text, cut


def _json_size(text: str) -> int:
    """Bytes ``text`` takes as a JSON string on the wire (protocol: ensure_ascii=False)."""
    escaped = json.dumps(text, ensure_ascii=False)
    return len(escaped) if escaped.isascii() else len(escaped.encode())


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# ---------------------------------------------------------------------------
# Files (blocking; the verbs run them in a thread)


def _open_regular(path: str, flags: int) -> int:
    """Open ``path`` without blocking and return the descriptor if it is a
    regular file; a FIFO, socket or device is refused (``failed``)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise VerbError(f"{path} is not a regular file (the file verbs refuse FIFOs, sockets and devices)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(p: dict[str, Any]) -> dict[str, Any]:
    try:
        with open(_open_regular(p["path"], os.O_RDONLY), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(p["offset"])
            data = f.read(p["max_bytes"])
    except FileNotFoundError:
        raise VerbError(f"no such file: {p['path']}", ERR_NOT_FOUND) from None
    except OSError as exc:
        raise VerbError(f"cannot read {p['path']}: {exc.strerror or exc}", ERR_FAILED) from None
    return {
        "data": base64.b64encode(data).decode("ascii"),
        "size": size,
        "offset": p["offset"],
        "bytes": len(data),
        "truncated": p["offset"] + len(data) < size,
    }


def write_file(p: dict[str, Any]) -> dict[str, Any]:
    path = p["path"]
    try:
        if p["make_dirs"]:
            _make_dirs(os.path.dirname(os.path.abspath(path)))
        with contextlib.suppress(FileNotFoundError):  # refused before O_TRUNC can touch it
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise VerbError(f"{path} is not a regular file (the file verbs refuse FIFOs, sockets and devices)")
        existed = os.path.lexists(path)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if p["append"] else os.O_TRUNC)
        with open(_open_regular(path, flags), "ab" if p["append"] else "wb") as f:
            if not existed:  # created by this call: the agent's file
                identity.chown_to_agent(f.fileno())
            f.write(p["data"])
            if p["mode"] is not None:
                os.fchmod(f.fileno(), p["mode"])
    except FileNotFoundError:
        raise VerbError(f"no such directory for {path} (pass make_dirs=true)", ERR_NOT_FOUND) from None
    except OSError as exc:
        raise VerbError(f"cannot write {path}: {exc.strerror or exc}", ERR_FAILED) from None
    return {"path": os.path.abspath(path), "bytes_written": len(p["data"])}


def _make_dirs(path: str) -> None:
    """``os.makedirs``, each directory it creates given to the agent (if any)."""
    missing = []
    while path and not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory)
            identity.chown_to_agent(directory)
