"""Sandboxes that are sandboxes: each shinkend in its own namespaces, cgroup and filesystem.

:class:`IsolatedProvider` starts every daemon under bubblewrap (``bwrap``, Debian's
``bubblewrap``) with its own user, PID, mount, network, IPC, UTS and cgroup
namespaces; docs/sandboxes.md is the reference (the isolation model, what an agent
can and cannot reach, running it in production). Per sandbox:

* **Users.** Each sandbox holds a slot of two unprivileged host uids
  (``host_uid_base + 2 * slot`` for the daemon, ``+ 1`` for the agent; a slot is a
  lock file under ``state_dir`` the provider holds while the sandbox lives), so no
  two sandboxes share a host uid. bwrap runs as the daemon's; the provider writes
  the new user namespace's map itself (``--userns-block-fd``): inside uid 0 is the
  daemon's host uid (keeping only ``DAEMON_CAPS`` inside its namespace), inside
  ``agent_uid`` the agent's (every ``exec`` child, no capabilities). No uid of the
  sandbox is root on the host.
* **Filesystem.** Read-only: the given root filesystem, or the host's ``/usr`` and
  ``/etc`` plus this interpreter's prefixes and the ``shinken_sync`` package
  (opened by the provider and bound by descriptor, so no host path has to be
  readable by the sandbox's uid). Writable, sized, discarded with the sandbox:
  tmpfs on ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/home`` and ``/run``. ``/proc`` is
  the sandbox's own; ``/dev`` a minimal one.
* **Network.** Its own namespace holds only ``lo``. shinkend listens on a unix
  socket in ``/run/shinkend`` (mode 0700, the daemon's), a per-sandbox host
  directory bound in; the SDK dials it as ``ws+unix://...``. Nothing listens on
  any host address.
* **Token.** Written into a pipe the daemon reads to EOF (``--token-fd``): in no
  file, argv or environment. The daemon is non-dumpable.
* **Limits.** One cgroup (:mod:`.cgroups`, v1 or v2): memory, CPU, pids. The
  daemon is the OOM killer's first choice, so a sandbox out of memory dies whole
  and :meth:`check_alive` reports it ``oom=True`` from the cgroup's own counter.

Destroy kills the sandbox's PID namespace (its init, so the kernel kills every
process in it), waits for bwrap, removes the cgroup and the host directory. The
mounts live only in the sandbox's mount namespace and go with its last process.
A provider killed outright takes its sandboxes with it (``--die-with-parent``) but
cleans nothing; the next provider on the same ``state_dir`` removes what it left
(:func:`sweep_stale`, by the owner pid recorded in each sandbox's directory).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shinken_sync.lifetime import die_with_parent
from shinken_sync.native import close_now
from shinken_sync.protocol import split_unix_url, unix_url

from .base import Liveness
from .cgroups import CgroupLimits, SandboxCgroup
from .errors import IsolationUnavailable, ProviderError
from .local import LocalProvider, LocalSandbox
from .process import DEFAULT_START_TIMEOUT_S, TERMINATE_TIMEOUT_S, DaemonProcess

__all__ = ["DAEMON_CAPS", "IsolatedProvider", "IsolatedSandbox", "Isolation"]

#: What the daemon keeps, inside its own user namespace only: start children as the agent
#: (SETUID/SETGID), stop them (KILL), give the agent its files (CHOWN) and let the file verbs
#: reach the agent's files (DAC_OVERRIDE, FOWNER). No SYS_ADMIN: it cannot mount, nor undo
#: any of the isolation.
DAEMON_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER")
#: Inside the sandbox.
SOCKET_DIR = "/run/shinkend"
SOCKET_PATH = f"{SOCKET_DIR}/s"
AGENT_HOME = "/home/agent"
#: A unix socket's path must fit sockaddr_un.sun_path (108 bytes with the NUL).
MAX_SOCKET_PATH = 107
#: How long bwrap may take to create the namespaces and report its child's pid.
SETUP_TIMEOUT_S = 10.0
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The sandbox's writable layer: a sized tmpfs each (path -> mode), gone with the sandbox.
_WRITABLE = {"/tmp": "1777", "/var/tmp": "1777", "/dev/shm": "1777", "/home": "0755", "/run": "0755"}
#: Host caches a desktop starts faster with (fontconfig's: Chromium and xterm would rebuild it
#: per sandbox, seconds each), bound read-only when the host has them.
_HOST_CACHES = [path for path in ("/var/cache/fontconfig",) if os.path.isdir(path)]
#: Host top-level directories a merged-/usr system links into /usr (bound as the same links).
_USR_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


@dataclass(frozen=True)
class Isolation:
    """How each sandbox is isolated; ``shinken_sync.providers.config.IsolatedConfig`` holds
    the same fields as settings. None for a limit: not limited."""

    rootfs: str | None = None
    python: str = "/usr/bin/python3"
    memory_mb: int | None = 2048
    cpus: float | None = 1.0
    pids: int | None = 512
    tmpfs_mb: int = 512
    #: Host uids ``[host_uid_base, host_uid_base + 2 * host_uid_slots)`` belong to sandboxes.
    host_uid_base: int = 1_900_000_000
    host_uid_slots: int = 4096
    agent_uid: int = 1000
    state_dir: str | None = None
    ro_binds: tuple[str, ...] = ()
    cgroup_parent: str | None = None
    bwrap: str = "bwrap"

    @property
    def limits(self) -> CgroupLimits | None:
        if self.memory_mb is None and self.cpus is None and self.pids is None:
            return None
        memory = None if self.memory_mb is None else self.memory_mb * 2**20
        return CgroupLimits(memory, self.cpus, self.pids)

    def check(self) -> str:
        """The bwrap executable's path, once everything this host needs is there; else
        :class:`IsolationUnavailable` naming what is missing and the fix."""
        bwrap = shutil.which(self.bwrap)
        if bwrap is None:
            raise IsolationUnavailable(
                f"isolated sandboxes need bubblewrap: {self.bwrap!r} is not on PATH "
                f"(apt-get install bubblewrap, or pass bwrap= with its path)"
            )
        if self.rootfs is not None:
            if not os.path.isdir(self.rootfs):
                raise IsolationUnavailable(
                    f"root filesystem {self.rootfs!r} is not a directory (build it: docs/sandboxes.md, "
                    f"or pass rootfs=None to use the host's /usr read-only)"
                )
            if not os.path.exists(os.path.join(self.rootfs, self.python.lstrip("/"))):
                raise IsolationUnavailable(
                    f"root filesystem {self.rootfs!r} has no {self.python} (install python3 and shinken "
                    f"into it: docs/sandboxes.md, or pass python= with its interpreter)"
                )
        if os.geteuid() != 0:
            raise IsolationUnavailable(
                "isolated sandboxes need root on the host (to map the sandbox's users and create its "
                "cgroup); run as root, or use the local provider"
            )
        if self.agent_uid < 1 or self.host_uid_base < 1 or self.host_uid_slots < 1 \
                or self.host_uid_base + 2 * self.host_uid_slots >= 2**32 - 1:
            raise IsolationUnavailable("agent_uid and host_uid_base must be >= 1, host_uid_slots >= 1, and the "
                                       "range below 2**32 - 1")
        return bwrap


def _package_dir() -> str:
    import shinken_sync

    return os.path.dirname(os.path.realpath(shinken_sync.__file__))


def host_binds() -> list[str]:
    """What a sandbox without its own root filesystem needs of the host, read-only: this
    interpreter (prefix, base prefix) and the ``shinken_sync`` package (an editable
    install lives outside them), each once and outside /usr."""
    candidates = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, _package_dir()]
    paths: list[str] = []
    for path in sorted({os.path.realpath(p) for p in candidates}, key=len):
        if path == "/usr" or path.startswith("/usr/") or any(path.startswith(p + "/") for p in paths):
            continue
        paths.append(path)
    return paths


def _others_can_read(path: str, read: bool = True) -> bool:
    """Whether a uid with no group in common with the owners can reach ``path`` (and read it)."""
    parts = os.path.realpath(path).split("/")
    for i in range(2, len(parts)):
        if not os.stat("/".join(parts[:i]) or "/").st_mode & 0o001:
            return False
    mode = os.stat(path).st_mode
    if not read:
        return not stat.S_ISDIR(mode) or bool(mode & 0o001)
    return bool(mode & 0o004) and (not stat.S_ISDIR(mode) or bool(mode & 0o001))


_CLONE_NEWNS = 0x00020000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)  # resolved in the parent: a preexec_fn loads nothing
_unshare, _mount = _libc.unshare, _libc.mount  # Linux only, as bubblewrap is


def launcher_preexec(staged: list[tuple[str, str]], uid: int, parent_pid: int) -> None:
    """In bwrap's process before exec: stage what the sandbox's uid cannot reach (bind
    mounts in a mount namespace of this process only), drop to that uid, die with the parent."""
    if staged:
        if _unshare(_CLONE_NEWNS) != 0 or _mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
            raise OSError(ctypes.get_errno(), "cannot make the launcher's mount namespace")
        for source, stage in staged:
            if _mount(source.encode(), stage.encode(), None, _MS_BIND | _MS_REC, None) != 0:
                raise OSError(ctypes.get_errno(), f"cannot stage {source}")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    die_with_parent(parent_pid, signal.SIGTERM)


OWNER_FILE = "owner.json"


def _start_time(pid: int) -> str | None:
    """``pid``'s start time in clock ticks since boot (tells a reused pid apart), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def sweep_stale(isolation: Isolation) -> list[str]:
    """Remove what dead providers left under ``isolation.state_dir``: the directories
    (and the cgroups) of sandboxes whose provider process is gone. The sandboxes
    themselves died with it (bwrap ``--die-with-parent``); a cgroup still holding a
    process is left alone. Returns the sandbox names swept."""
    parent = isolation.state_dir or tempfile.gettempdir()
    swept: list[str] = []
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith("shk-") and e.is_dir(follow_symlinks=False)]
    except OSError:
        return swept
    for entry in entries:
        try:
            with open(os.path.join(entry.path, OWNER_FILE)) as f:
                owner = json.load(f)
            pid, start, name = int(owner["pid"]), owner["start"], str(owner["name"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not one of ours, or still being written
        if _start_time(pid) == start and start is not None:
            continue  # its provider lives
        if isolation.limits is not None and not SandboxCgroup.remove_stale(name, isolation.cgroup_parent):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        swept.append(name)
    return swept


@dataclass(eq=False)
class IsolatedSandbox(LocalSandbox):
    """Handle of one isolated sandbox: ``pid`` is bwrap's on the host (the sandbox's processes
    are its descendants), ``daemon`` its :class:`IsolatedDaemon`."""


class IsolatedDaemon(DaemonProcess):
    """A shinkend inside a bubblewrap sandbox (see the module docstring)."""

    def __init__(self, argv: list[str], name: str, isolation: Isolation, bwrap: str):
        self.isolation = isolation
        self._bwrap = bwrap
        self.cgroup: SandboxCgroup | None = None
        self.host_dir = ""
        self._init_pid: int | None = None
        self._fds: dict[str, int] = {}  # ours, closed after the spawn
        self._child_fds: list[int] = []  # the child's ends, closed in the parent after the spawn
        self._cleaned = False
        self._cleanup_lock = threading.Lock()
        self._slot_fd: int | None = None
        self.daemon_host_uid = self.agent_host_uid = -1
        super().__init__(argv, name)

    def _claim_uid_slot(self, state_dir: str) -> tuple[int, int]:
        """The first free slot's host uids, its lock held (``flock``: released by the kernel
        if this process dies, when the sandbox dies with it) until :meth:`_cleanup`."""
        iso = self.isolation
        slots = os.path.join(state_dir, ".shinken-uid-slots")
        with contextlib.suppress(FileExistsError):
            os.mkdir(slots, 0o700)
        for slot in range(iso.host_uid_slots):
            fd = os.open(os.path.join(slots, str(slot)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                close_now(fd)
                continue
            self._slot_fd = fd
            base = iso.host_uid_base + 2 * slot
            return base, base + 1
        raise IsolationUnavailable(f"all {iso.host_uid_slots} host uid slots under {slots} are taken; "
                                   f"raise host_uid_slots")

    # -- DaemonProcess hooks -------------------------------------------------------

    def _prepare(self) -> None:
        iso = self.isolation
        parent = iso.state_dir or tempfile.gettempdir()
        if not _others_can_read(parent, read=False):
            raise IsolationUnavailable(
                f"state_dir {parent!r} cannot be traversed by the sandbox's unprivileged uid (bwrap runs "
                f"as it and binds its socket directory from there); chmod o+x it or pass another state_dir"
            )
        self.daemon_host_uid, self.agent_host_uid = self._claim_uid_slot(parent)
        self.host_dir = tempfile.mkdtemp(prefix="shk-", dir=parent)  # 0700, root's
        sock_dir = os.path.join(self.host_dir, "sock")
        if len(os.path.join(sock_dir, "s")) > MAX_SOCKET_PATH:
            raise IsolationUnavailable(
                f"the sandbox's socket path under state_dir={iso.state_dir!r} is longer than a unix socket "
                f"allows ({MAX_SOCKET_PATH} bytes); pass a shorter state_dir"
            )
        os.mkdir(sock_dir, 0o700)
        os.chown(sock_dir, self.daemon_host_uid, self.daemon_host_uid)  # inside: uid 0's, 0700
        # Who owns this directory and the sandbox's cgroup: a provider killed with SIGKILL
        # cleans nothing, the next one on the same state_dir does (sweep_stale).
        with open(os.path.join(self.host_dir, OWNER_FILE), "w") as f:
            json.dump({"pid": os.getpid(), "start": _start_time(os.getpid()), "name": self.name}, f)
        limits = iso.limits
        if limits is not None:
            self.cgroup = SandboxCgroup.create(self.name, limits, iso.cgroup_parent)
        super()._prepare()  # the token pipe
        # bwrap's ends go to _child_fds only: closed once, right after the spawn (a second
        # close could hit a descriptor another thread just opened under the same number).
        self._block_child, self._fds["block"] = os.pipe()
        self._fds["info"], self._info_child = os.pipe()
        self._child_fds += [self._block_child, self._info_child]
        sources = [iso.rootfs] if iso.rootfs else ["/usr", "/etc", *_HOST_CACHES, *host_binds()]
        sources += list(iso.ro_binds)
        # bwrap runs as the daemon's host uid: what that uid cannot reach (this machine's Python
        # under /root, say) is staged, bound by root under host_dir in a mount namespace of the
        # launcher's own, which disappears with the sandbox (see launcher_preexec).
        os.chmod(self.host_dir, 0o711)
        self._binds: list[tuple[str, str]] = []  # (source as bwrap sees it, destination)
        self._staged: list[tuple[str, str]] = []  # (host path, staging mount point)
        for path in sources:
            if not os.path.exists(path):
                raise IsolationUnavailable(f"cannot bind {path!r} into the sandbox: it does not exist")
            dest = "/" if path == iso.rootfs else path
            if not _others_can_read(path):
                stage = os.path.join(self.host_dir, f"stage{len(self._staged)}")
                os.mkdir(stage, 0o755) if os.path.isdir(path) else open(stage, "x").close()
                self._staged.append((path, stage))
                path = stage
            self._binds.append((path, dest))
        self._sock_dir = sock_dir
        # Without a root filesystem /etc is the host's: its passwd and group would name the
        # host's users (and the agent after whoever has uid 1000 there).
        self._data: dict[str, int] = {}
        if iso.rootfs is None:
            users = {"/etc/passwd": f"root:x:0:0:shinkend:/root:/usr/sbin/nologin\n"
                                    f"agent:x:{iso.agent_uid}:{iso.agent_uid}:agent:{AGENT_HOME}:/bin/sh\n",
                     "/etc/group": f"root:x:0:\nagent:x:{iso.agent_uid}:\n"}  # fmt: skip
            for path, text in users.items():
                read_end, write_end = os.pipe()
                os.write(write_end, text.encode())
                close_now(write_end)
                self._child_fds.append(read_end)
                self._data[path] = read_end

    def _command(self, argv: list[str]) -> list[str]:
        iso = self.isolation
        mb = 2**20
        cmd = [
            self._bwrap,
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup", "--hostname", self.name[:64],
            "--userns-block-fd", str(self._block_child), "--info-fd", str(self._info_child),
            "--die-with-parent", "--new-session",
        ]  # fmt: skip
        for source, dest in self._binds:
            if dest == "/":
                cmd += ["--ro-bind", source, "/"]
        if iso.rootfs is None:
            for name in _USR_LINKS:
                host = f"/{name}"
                if os.path.islink(host):
                    cmd += ["--symlink", os.readlink(host), host]
                elif os.path.isdir(host):
                    cmd += ["--ro-bind", host, host]
        size = str(iso.tmpfs_mb * mb)
        cmd += ["--proc", "/proc", "--dev", "/dev"]
        for path, perms in _WRITABLE.items():
            cmd += ["--perms", perms, "--size", size, "--tmpfs", path]
        # After the tmpfs mounts, which would hide a bind below them (a venv under /tmp, say). The
        # directories leading to each are made 0755 first: bwrap would make them 0700, the
        # daemon's, and the agent could not reach a bound interpreter or package through them.
        made = {"/", "/usr", "/etc", *_WRITABLE}
        for source, dest in self._binds:
            if dest == "/":
                continue
            parts = dest.split("/")
            for i in range(2, len(parts)):
                parent = "/".join(parts[:i])
                if parent not in made:
                    made.add(parent)
                    cmd += ["--perms", "0755", "--dir", parent]
            cmd += ["--ro-bind", source, dest]
        cmd += ["--bind", self._sock_dir, SOCKET_DIR]
        for path, fd in self._data.items():  # over the host's /etc: the sandbox's own users only
            cmd += ["--perms", "0644", "--ro-bind-data", str(fd), path]
        if iso.rootfs is None:
            cmd += ["--remount-ro", "/"]  # bwrap's own root: only the mounts above are writable
        cmd += ["--clearenv", "--setenv", "PATH", SANDBOX_PATH, "--setenv", "LANG", "C.UTF-8",
                "--setenv", "HOME", "/root", "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--chdir", "/",
                "--cap-drop", "ALL"]  # fmt: skip
        if iso.rootfs is None:
            # The daemon imports the shinken_sync this process runs (bound above), whatever put it
            # on this process's path (an editable install, PYTHONPATH).
            cmd += ["--setenv", "PYTHONPATH", os.path.dirname(_package_dir())]
        for cap in DAEMON_CAPS:
            cmd += ["--cap-add", cap]
        python = iso.python if iso.rootfs else sys.executable
        cmd += ["--", python, "-m", "shinken_sync.daemon.server", "--token-fd", str(self._token_fd),
                "--unix", SOCKET_PATH, "--exec-user", f"{iso.agent_uid}:{iso.agent_uid}",
                "--exec-home", AGENT_HOME, *argv]  # fmt: skip
        return cmd

    def _pass_fds(self) -> list[int]:
        return [*super()._pass_fds(), *self._child_fds]

    def _preexec(self) -> Callable[[], None]:
        # One spawner thread (see .process); the preexec makes only system calls.
        return functools.partial(launcher_preexec, self._staged, self.daemon_host_uid, os.getpid())

    def _spawned(self) -> None:
        self._forget_token()
        for fd in self._child_fds:
            close_now(fd)
        self._child_fds.clear()
        self._init_pid = pid = self._read_init_pid()
        iso = self.isolation
        try:
            if self.cgroup is not None:
                self.cgroup.add(self.process.pid)
                self.cgroup.add(pid)  # still blocked: it has started nothing yet
            # Inside uid 0 = the daemon's host uid, agent_uid = the agent's; nothing else exists.
            mapping = f"0 {self.daemon_host_uid} 1\n{iso.agent_uid} {self.agent_host_uid} 1\n"
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(mapping)
            # Written by root, 0 is also the floor unprivileged processes may lower their score to:
            # the agent's children go back to 0 after the daemon raised its own (daemon/identity.py).
            with open(f"/proc/{pid}/oom_score_adj", "w") as f:
                f.write("0")
        except OSError as exc:
            raise IsolationUnavailable(f"cannot set up sandbox {self.name}'s user namespace: {exc}") from None
        os.write(self._fds["block"], b"1")
        self._close_fds()
        self._oom_counter = self.cgroup.oom_counter if self.cgroup is not None else None
        self._oom_kills_at_start = 0 if self.cgroup is not None else None

    def _read_init_pid(self) -> int:
        data = bytearray()
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        with selectors.DefaultSelector() as sel:
            sel.register(self._fds["info"], selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    continue
                chunk = os.read(self._fds["info"], 65536)
                if not chunk:
                    break
                data += chunk
        try:
            return int(json.loads(bytes(data))["child-pid"])
        except (ValueError, KeyError, TypeError):
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(TERMINATE_TIMEOUT_S)
        said = self.stderr_tail().strip().splitlines()
        raise IsolationUnavailable(
            f"bubblewrap could not create sandbox {self.name}'s namespaces"
            f"{': ' + said[-1] if said else ''} (needs a kernel with user, PID, mount and network "
            f"namespaces: user.max_user_namespaces > 0, and on Debian kernels kernel.unprivileged_userns_clone=1)"
        )

    def _close_fds(self) -> None:
        for fd in list(self._fds.values()) + self._child_fds:
            with contextlib.suppress(OSError):
                close_now(fd)
        self._fds.clear()
        self._child_fds.clear()

    def _abandon(self) -> None:
        self._kill_sandbox()
        super()._abandon()
        self._close_fds()
        self._cleanup()

    # -- the endpoint ----------------------------------------------------------------

    @property
    def url(self) -> str:
        """The ready line's ``ws+unix://`` URL with the socket's host path."""
        inside = split_unix_url(self.ready["url"])
        if inside is None or not inside[0].startswith(SOCKET_DIR + "/"):
            raise ProviderError(f"sandbox {self.name}: unexpected ready url {self.ready['url']!r}")
        host_socket = os.path.join(self.host_dir, "sock", inside[0][len(SOCKET_DIR) + 1:])
        return unix_url(host_socket, "/" + inside[1].split("/", 3)[3])

    # -- probing and stopping --------------------------------------------------------

    def liveness(self) -> Liveness:
        rc = self.process.poll()
        oom_kills = self.cgroup.oom_kills() if self.cgroup is not None else None
        if rc is None:
            return Liveness(alive=True)
        # bwrap exits with its command's status, a signal death as 128 + the signal number.
        sig = -rc if rc < 0 else rc - 128 if rc > 128 else None
        if oom_kills:
            return Liveness(alive=False, signal=sig, oom=True,
                            detail=f"sandbox {self.name} ran out of memory: the kernel's OOM killer ended it "
                                   f"(its memory cgroup counted {oom_kills} OOM kill(s))")  # fmt: skip
        if sig is not None:
            return Liveness(alive=False, signal=sig, detail=f"sandbox {self.name}'s shinkend killed by signal {sig}")
        return Liveness(alive=False, exit_code=rc, detail=f"sandbox {self.name}'s shinkend exited with code {rc}")

    def _kill_sandbox(self) -> None:
        process = getattr(self, "process", None)
        # The init is bwrap's child: its pid stays ours until bwrap reaps it, so only while bwrap runs.
        if self._init_pid is not None and process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._init_pid, signal.SIGKILL)  # the PID namespace goes with its init
        if self.cgroup is not None:
            self.cgroup.kill()

    def terminate(self, timeout: float = TERMINATE_TIMEOUT_S) -> None:
        """Kill the whole sandbox (nothing in it outlives its writable layer), then clean up."""
        self._kill_sandbox()
        super().terminate(timeout)
        self._cleanup()

    def _cleanup(self) -> None:
        with self._cleanup_lock:
            if self._cleaned:
                return
            self._cleaned = True
        try:
            if self.cgroup is not None:
                self.cgroup.remove()
        finally:
            if self.host_dir:
                shutil.rmtree(self.host_dir, ignore_errors=True)
            if self._slot_fd is not None:  # the uids are free again once nothing runs as them
                close_now(self._slot_fd)
                self._slot_fd = None


class IsolatedProvider(LocalProvider):
    """One isolated sandbox per shinkend (module docstring; docs/sandboxes.md).

    ``display``, ``screen``, ``rtt_ms``, ``stream_grace`` and ``extra_args`` (more
    shinkend flags, e.g. a desktop's) are the defaults for :meth:`create` /
    :meth:`create_many`, as with :class:`~.local.LocalProvider`, whose sandbox
    bookkeeping this is; ``isolation`` is how every sandbox is isolated. What this
    host lacks is reported at once (:class:`~.errors.IsolationUnavailable`), before
    anything starts. The daemons' ``--host``/``--port`` are ignored: each listens on
    its unix socket only.
    """

    _id_word = "iso"

    def __init__(
        self,
        display: str = "virtual",
        screen: tuple[int, int] = (1920, 1080),
        rtt_ms: float = 0.0,
        *,
        stream_grace: float | None = None,
        extra_args: list[str] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        isolation: Isolation | None = None,
    ):
        self.isolation = isolation or Isolation()
        self._bwrap = self.isolation.check()
        sweep_stale(self.isolation)
        super().__init__(display, screen, rtt_ms, stream_grace=stream_grace, extra_args=extra_args,
                         start_timeout=start_timeout)

    def _spawn(self, argv: list[str], name: str) -> DaemonProcess:
        return IsolatedDaemon(argv, name, self.isolation, self._bwrap)

    def _handle(self, daemon: DaemonProcess) -> IsolatedSandbox:
        assert isinstance(daemon, IsolatedDaemon)
        return IsolatedSandbox(daemon.ready.get("sandbox_id", daemon.name), daemon.url, daemon.token, daemon)


