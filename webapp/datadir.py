"""Where a session server keeps its sessions, and who owns that place.

The data directory (setting ``data_dir``) holds::

    <data_dir>/lock          flock'ed by the one server process that owns the directory
    <data_dir>/instance_id   miles' session_server_instance_id, minted once: sessions outlive a
                             restart, so the id a client compares does too
    <data_dir>/sessions/     one journal per session (webapp.journal)
    <data_dir>/tombstones/   one file per worker of deleted/expired session ids (webapp.tombstones)

Who may touch it: this server's user only. A root server follows no symlink in it (a planted
``lock`` or ``instance_id`` link would make it write or publish another file), so every file is
opened with ``O_NOFOLLOW`` and checked to be a regular file (:func:`open_private`), created
``0600`` (journals hold prompts: another local user must not read them) in directories made
``0700``; a data directory that is group- or world-writable, or another user's, is refused
(:class:`DataDirUnsafe`): whoever may write it could plant such links or files.

Unset, it is ``$XDG_STATE_HOME/shinken/session-server/<name>`` (``~/.local/state`` without
``XDG_STATE_HOME``), ``<name>`` being ``HOST-PORT`` of ``shinken-session-server``'s bind
address, or ``default`` for an app built without the launcher: a server restarted on the same
address finds its sessions again, two servers on different ports never share a directory.

Imports nothing of the session core, so the router may use it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import uuid

from webapp.errors import WebappError

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "DataDirInUse",
    "DataDirUnsafe",
    "check_free",
    "default_data_dir",
    "ensure_private_dir",
    "instance_id",
    "lock_data_dir",
    "open_private",
    "sessions_dir",
]

log = logging.getLogger(__name__)

FILE_MODE = 0o600  # every file of a data directory
DIR_MODE = 0o700  # every directory the server makes in it
USAGE_FILE = "usage"  # webapp.journal's shared session/byte counts, rebuilt by the owner at start

DEFAULT_NAME = "default"
_owned: dict[str, int] = {}  # data dir -> the fd holding its lock, for this process's life


class DataDirInUse(WebappError, RuntimeError):
    """Another server process holds the data directory: two writers would corrupt journals."""


class DataDirUnsafe(WebappError, RuntimeError):
    """The data directory (or a file in it) is not this server's alone: writable by others,
    another user's, or a symlink / non-regular file where a file of ours should be."""


def ensure_private_dir(path: str, *, tighten: bool = True) -> None:
    """Make ``path`` (mode 0700) if missing, then check it: a directory, this user's, writable by
    no one else; ``tighten``: a looser mode of a directory we own becomes 0700 (journals inside
    stay private). Raises :class:`DataDirUnsafe`."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    st = os.stat(path)  # the operator's path may itself be a link: checked where it points
    if not stat.S_ISDIR(st.st_mode):
        raise DataDirUnsafe(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise DataDirUnsafe(f"{path} belongs to uid {st.st_uid}, not to this server's uid {os.geteuid()}: "
                            f"another user could plant files in it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DataDirUnsafe(f"{path} is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):o}): "
                            f"anyone who may write it could plant symlinks the server would follow; "
                            f"chmod go-w it or pass another --data-dir")
    if tighten and stat.S_IMODE(st.st_mode) & 0o077:
        log.warning("%s had mode %o; made %o (its files hold prompts)", path, stat.S_IMODE(st.st_mode), DIR_MODE)
        os.chmod(path, DIR_MODE)


def open_private(path: str, flags: int, mode: int = FILE_MODE) -> int:
    """``os.open`` of a data directory file that never follows a symlink (``O_NOFOLLOW``; with
    ``O_CREAT`` a dangling link is refused too) and is a regular file; created ``mode`` (0600).
    Raises :class:`DataDirUnsafe` for a link or anything but a regular file; other ``OSError``
    as is (``FileNotFoundError``, ``FileExistsError``)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DataDirUnsafe(f"{path} is a symlink: the server does not follow links in its data directory") \
                from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataDirUnsafe(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise DataDirUnsafe(f"{path} belongs to uid {st.st_uid}, not to this server's uid {os.geteuid()}")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, FILE_MODE)  # written by an older server: private from now on
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
    """The fd holding ``data_dir``'s lock (created with the directory if need be).
    Raises :class:`DataDirUnsafe` (see the module doc)."""
    ensure_private_dir(data_dir, tighten=False)  # the operator's: refused if unsafe, its mode theirs
    ensure_private_dir(sessions_dir(data_dir))  # ours: the journals
    fd = open_private(os.path.join(data_dir, "lock"), os.O_RDWR | os.O_CREAT)
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
        # The shared counts may be off after a crash (an append or delete half done): the
        # owner starts them afresh, the first user rebuilds them from the files (webapp.journal).
        try:
            os.unlink(os.path.join(data_dir, USAGE_FILE))
        except FileNotFoundError:
            pass


def instance_id(data_dir: str) -> str:
    """The directory's session_server_instance_id, minted on first use. Raises
    :class:`DataDirUnsafe` if ``instance_id`` is a link or not a regular file (it is shown on
    the open ``/health``: a link would publish whatever it names)."""
    path = os.path.join(data_dir, "instance_id")
    try:
        return _read_private(path)
    except FileNotFoundError:
        pass
    ensure_private_dir(data_dir, tighten=False)
    value = uuid.uuid4().hex
    # A fresh random name, created exclusively: a planted link of that name fails the create
    # (O_EXCL never follows) instead of having its target overwritten.
    tmp = os.path.join(data_dir, f"instance_id.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, (value + "\n").encode())
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # first writer wins; a racing one reads the winner's
    except FileExistsError:
        value = _read_private(path)
    finally:
        os.unlink(tmp)
    return value


def _read_private(path: str) -> str:
    fd = open_private(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
