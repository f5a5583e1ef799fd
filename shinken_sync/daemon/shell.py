"""The sandbox's shell and file verbs: ``exec``, ``read_file``, ``write_file``.

``exec`` runs ``/bin/sh -c CMD`` in a new session (its own process group), so a
timeout kills the whole group, grandchildren included. Output is captured up to
a per-stream cap; past the cap it is read and discarded (the child never blocks
on a full pipe) and the reply says ``stdout_truncated``. A command that leaves a
background process holding its stdout is not waited for beyond
:data:`DRAIN_GRACE_S` after the shell exits.

File contents travel base64-encoded inside the JSON reply: files are not the
image hot path, and base64 keeps them binary-safe.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import signal
import time
from typing import Any

from shinken_sync.protocol import ERR_FAILED, ERR_NOT_FOUND

from .errors import VerbError, VerbTimeout

log = logging.getLogger("shinkend.shell")

#: How long to keep reading a command's pipes after the shell itself exited.
DRAIN_GRACE_S = 0.5
_CHUNK = 64 * 2**10


class Shell:
    """Runs commands for one sandbox and remembers their process groups, so
    :meth:`close` leaves nothing behind when the daemon stops."""

    def __init__(self) -> None:
        self._groups: set[int] = set()

    async def exec(self, p: dict[str, Any]) -> dict[str, Any]:
        env = None if p["env"] is None else {**os.environ, **p["env"]}
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh",
                "-c",
                p["cmd"],
                stdin=asyncio.subprocess.PIPE if p["stdin"] is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=p["cwd"],
                env=env,
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise VerbError(f"cannot run command: {exc}", ERR_NOT_FOUND) from None
        except OSError as exc:
            raise VerbError(f"cannot run command: {exc}") from None
        self._groups.add(proc.pid)
        cap = p["max_output"]
        out, err = _Capture(cap), _Capture(cap)
        pumps = [
            asyncio.ensure_future(out.pump(proc.stdout)),
            asyncio.ensure_future(err.pump(proc.stderr)),
        ]
        if p["stdin"] is not None:
            pumps.append(asyncio.ensure_future(_feed(proc.stdin, p["stdin"])))
        timeout_s = p["timeout_ms"] / 1000
        try:
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
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
                    await asyncio.wait_for(proc.wait(), 1.0)
            # Background processes the command left may outlive it in the group.
            if proc.returncode is not None and not _group_alive(proc.pid):
                self._groups.discard(proc.pid)
        rc = proc.returncode
        encode = _encoder(p["encoding"])
        return {
            "exit_code": rc if rc >= 0 else None,
            "signal": -rc if rc < 0 else None,
            "stdout": encode(out.data),
            "stderr": encode(err.data),
            "stdout_truncated": out.truncated,
            "stderr_truncated": err.truncated,
            "encoding": p["encoding"],
            "duration_ms": round((time.monotonic() - started) * 1000, 1),
        }

    def close(self) -> None:
        """Kill every process group a command started and that is still alive."""
        for pgid in self._groups:
            _kill_group(pgid)
        self._groups.clear()


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


def _encoder(encoding: str):
    if encoding == "base64":
        return lambda data: base64.b64encode(data).decode("ascii")
    return lambda data: data.decode("utf-8", errors="replace")


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


def read_file(p: dict[str, Any]) -> dict[str, Any]:
    try:
        with open(p["path"], "rb") as f:
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
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "ab" if p["append"] else "wb") as f:
            f.write(p["data"])
            if p["mode"] is not None:
                os.fchmod(f.fileno(), p["mode"])
    except FileNotFoundError:
        raise VerbError(f"no such directory for {path} (pass make_dirs=true)", ERR_NOT_FOUND) from None
    except OSError as exc:
        raise VerbError(f"cannot write {path}: {exc.strerror or exc}", ERR_FAILED) from None
    return {"path": os.path.abspath(path), "bytes_written": len(p["data"])}
