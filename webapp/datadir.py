"""Where a session server keeps its sessions, and who owns that place.

The data directory (setting ``data_dir``) holds::

    <data_dir>/lock          flock'ed by the one server process that owns the directory
    <data_dir>/instance_id   miles' session_server_instance_id, minted once: sessions outlive a
                             restart, so the id a client compares does too
    <data_dir>/sessions/     one journal per session (webapp.journal)

Unset, it is ``$XDG_STATE_HOME/shinken/session-server/<name>`` (``~/.local/state`` without
``XDG_STATE_HOME``), ``<name>`` being ``HOST-PORT`` of ``shinken-session-server``'s bind
address, or ``default`` for an app built without the launcher: a server restarted on the same
address finds its sessions again, two servers on different ports never share a directory.

Imports nothing of the session core, so the router may use it.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path

from webapp.errors import WebappError

__all__ = ["DataDirInUse", "check_free", "default_data_dir", "instance_id", "lock_data_dir", "sessions_dir"]

DEFAULT_NAME = "default"
_owned: dict[str, int] = {}  # data dir -> the fd holding its lock, for this process's life


class DataDirInUse(WebappError, RuntimeError):
    """Another server process holds the data directory: two writers would corrupt journals."""


def default_data_dir(name: str = DEFAULT_NAME) -> str:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "shinken", "session-server", name.replace(":", "_").replace("/", "_"))


def sessions_dir(data_dir: str) -> str:
    return os.path.join(data_dir, "sessions")


def check_free(data_dir: str) -> None:
    """Raise :class:`DataDirInUse` if another process owns ``data_dir`` (without taking it:
    the launcher asks before it starts the server that will)."""
    os.close(_take_lock(os.path.abspath(data_dir)))


def _take_lock(data_dir: str) -> int:
    """The fd holding ``data_dir``'s lock (created with the directory if need be)."""
    os.makedirs(sessions_dir(data_dir), exist_ok=True)
    fd = os.open(os.path.join(data_dir, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirInUse(f"data directory {data_dir} is in use by another session server "
                           f"(pass --data-dir to give this one its own)") from None
    return fd


def lock_data_dir(data_dir: str) -> None:
    """Own ``data_dir`` for this process's lifetime (idempotent); raises :class:`DataDirInUse`.

    Only the process that spawns the session workers (the router, or the single-process app)
    takes it: the workers it supervises write under its ownership, one shard each."""
    data_dir = os.path.abspath(data_dir)
    if data_dir not in _owned:
        _owned[data_dir] = _take_lock(data_dir)


def instance_id(data_dir: str) -> str:
    """The directory's session_server_instance_id, minted on first use."""
    path = Path(data_dir, "instance_id")
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = uuid.uuid4().hex
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(value + "\n")
    try:
        os.link(tmp, path)  # first writer wins; a racing one reads the winner's
    except FileExistsError:
        value = path.read_text().strip()
    finally:
        tmp.unlink()
    return value
