"""One cgroup per isolated sandbox: memory, CPU and pids limits, its OOM count, its removal.

cgroup v2 (one unified hierarchy; most production hosts) and v1 (a hierarchy per
controller, as on the development machines) behind one class,
:class:`SandboxCgroup`. :func:`detect` picks what this host offers: v2 when
the unified hierarchy has the ``memory`` controller, else v1 when the memory
controller is mounted; none is :class:`~.errors.CgroupUnavailable`.

Where: under this process's own cgroup (per controller on v1), or under
``parent`` when given (on v2 a delegated subtree, e.g. a systemd unit with
``Delegate=yes``: v2 refuses to enable controllers below a cgroup that itself
holds processes). Each sandbox's cgroup is named ``shinken-<sandbox>``;
:meth:`SandboxCgroup.remove` kills what is left in it and removes it.

Files written (and read back through ``oom_kills``)::

    limit      v2                         v1
    memory     memory.max, memory.swap.max=0,   memory.limit_in_bytes,
               memory.oom.group=1              memory.memsw.limit_in_bytes (if swap accounting)
    CPU        cpu.max "QUOTA PERIOD"     cpu.cfs_period_us, cpu.cfs_quota_us
    pids       pids.max                   pids.max
    OOM kills  memory.events oom_kill     memory.oom_control oom_kill
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass

from .errors import CgroupUnavailable
from .process import read_oom_kills

__all__ = ["CgroupLimits", "SandboxCgroup", "detect"]

CGROUP_ROOT = "/sys/fs/cgroup"
CPU_PERIOD_US = 100_000
#: How long remove() keeps killing and retrying rmdir (a dying process holds its cgroup briefly).
REMOVE_TIMEOUT_S = 5.0
V1_CONTROLLERS = ("memory", "cpu", "pids")


@dataclass(frozen=True)
class CgroupLimits:
    """None: that resource is not limited."""

    memory_bytes: int | None = None
    cpus: float | None = None
    pids: int | None = None


def _own_paths() -> dict[str, str]:
    """Controller (v1) or "" (v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f.read().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                paths[""] = path
            for name in controllers.split(","):
                if name:
                    paths[name] = path
    return paths


def _mounts() -> dict[str, tuple[str, str]]:
    """Controller (v1) or "" (v2) -> (mount point, mount root), from /proc/self/mountinfo."""
    found: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            root, point, fstype, options = fields[3], fields[4], tail[0], tail[-1]
            if fstype == "cgroup2":
                found.setdefault("", (point, root))
            elif fstype == "cgroup":
                for name in options.split(","):
                    if name in V1_CONTROLLERS:
                        found.setdefault(name, (point, root))
    return found


def _join(point: str, root: str, path: str) -> str:
    # Inside a cgroup namespace or a container the mount's root may be a prefix of our path.
    if root != "/" and path.startswith(root):
        path = path[len(root):]
    return os.path.join(point, path.lstrip("/"))


def detect(parent: str | None = None) -> tuple[int, dict[str, str]]:
    """``(version, {controller: parent directory})`` for sandbox cgroups on this host.

    v2 answers ``{"": dir}``; v1 one directory per controller it found of
    memory, cpu and pids (memory is required). :class:`CgroupUnavailable`
    names what is missing.
    """
    mounts = _mounts()
    try:
        own = _own_paths()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot read /proc/self/cgroup: {exc}") from None
    if "" in mounts:
        point, root = mounts[""]
        base = parent or _join(point, root, own.get("", "/"))
        with contextlib.suppress(OSError), open(os.path.join(point, "cgroup.controllers")) as f:
            if "memory" in f.read().split():
                return 2, {"": base}
    if "memory" in mounts:
        dirs = {}
        for name in V1_CONTROLLERS:
            if name in mounts:
                point, root = mounts[name]
                dirs[name] = parent and os.path.join(point, parent.lstrip("/")) or _join(point, root, own.get(name, "/"))
        return 1, dirs
    raise CgroupUnavailable(
        "no memory cgroup controller is mounted (neither cgroup v2 with memory nor v1's memory hierarchy); "
        "mount one, or create the provider with cgroups disabled (memory_mb=None, cpus=None, pids=None)"
    )


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class SandboxCgroup:
    """The cgroup(s) of one sandbox. Create with :meth:`create`; always :meth:`remove`."""

    def __init__(self, version: int, dirs: dict[str, str]):
        self.version = version
        #: controller ("" on v2) -> this sandbox's cgroup directory
        self.dirs = dirs

    @classmethod
    def create(cls, name: str, limits: CgroupLimits, parent: str | None = None) -> SandboxCgroup:
        version, parents = detect(parent)
        made: dict[str, str] = {}
        group = cls(version, made)
        try:
            for controller, base in parents.items():
                path = os.path.join(base, f"shinken-{name}")
                try:
                    os.mkdir(path, 0o755)
                except OSError as exc:
                    raise CgroupUnavailable(
                        f"cannot create cgroup {path}: {exc.strerror}; run as root, or pass cgroup_parent= "
                        f"with a directory this user may create cgroups in"
                    ) from None
                made[controller] = path
            group._apply(limits)
        except BaseException:
            group.remove()
            raise
        return group

    @classmethod
    def remove_stale(cls, name: str, parent: str | None = None) -> bool:
        """Remove sandbox ``name``'s cgroup left by a dead provider; False (and left in
        place) while a process is still in it."""
        try:
            version, parents = detect(parent)
        except CgroupUnavailable:
            return True
        dirs = {c: os.path.join(base, f"shinken-{name}") for c, base in parents.items()}
        group = cls(version, {c: d for c, d in dirs.items() if os.path.isdir(d)})
        if group.pids():
            return False
        with contextlib.suppress(CgroupUnavailable):
            group.remove(timeout=0.5)
        return not group.dirs

    def _apply(self, limits: CgroupLimits) -> None:
        try:
            if self.version == 2:
                self._apply_v2(limits)
            else:
                self._apply_v1(limits)
        except OSError as exc:
            raise CgroupUnavailable(f"cannot set the sandbox's cgroup limits: {exc}") from None

    def _apply_v2(self, limits: CgroupLimits) -> None:
        d = self.dirs[""]
        wanted = [name for name, on in (("memory", limits.memory_bytes), ("cpu", limits.cpus),
                                        ("pids", limits.pids)) if on is not None]  # fmt: skip
        parent = os.path.dirname(d)
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            enabled = set(f.read().split())
        missing = [name for name in wanted if name not in enabled]
        if missing:
            try:
                _write(os.path.join(parent, "cgroup.subtree_control"), " ".join(f"+{n}" for n in missing))
            except OSError as exc:
                raise CgroupUnavailable(
                    f"cannot enable {missing} in {parent}/cgroup.subtree_control ({exc.strerror}): cgroup v2 "
                    f"enables controllers only below a cgroup without processes of its own; start under a "
                    f"delegated cgroup (systemd-run --scope -p Delegate=yes ...) and pass cgroup_parent="
                ) from None
        if limits.memory_bytes is not None:
            _write(os.path.join(d, "memory.max"), str(limits.memory_bytes))
            with contextlib.suppress(FileNotFoundError):  # no swap controller: nothing to escape to
                _write(os.path.join(d, "memory.swap.max"), "0")
            _write(os.path.join(d, "memory.oom.group"), "1")
        if limits.cpus is not None:
            _write(os.path.join(d, "cpu.max"), f"{max(1000, round(limits.cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")
        if limits.pids is not None:
            _write(os.path.join(d, "pids.max"), str(limits.pids))

    def _apply_v1(self, limits: CgroupLimits) -> None:
        for name, value in (("memory", limits.memory_bytes), ("cpu", limits.cpus), ("pids", limits.pids)):
            if value is not None and name not in self.dirs:
                raise CgroupUnavailable(f"no v1 {name} controller is mounted; mount it or pass {name}=None")
        if limits.memory_bytes is not None:
            d = self.dirs["memory"]
            _write(os.path.join(d, "memory.limit_in_bytes"), str(limits.memory_bytes))
            memsw = os.path.join(d, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):  # swap accounting on: memory + swap bounded too
                _write(memsw, str(limits.memory_bytes))
        if limits.cpus is not None:
            d = self.dirs["cpu"]
            _write(os.path.join(d, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
            _write(os.path.join(d, "cpu.cfs_quota_us"), str(max(1000, round(limits.cpus * CPU_PERIOD_US))))
        if limits.pids is not None:
            _write(os.path.join(self.dirs["pids"], "pids.max"), str(limits.pids))

    # -- membership --------------------------------------------------------------

    def add(self, pid: int) -> None:
        """Move ``pid`` (alone: its existing children stay where they are) into every controller."""
        for d in self.dirs.values():
            _write(os.path.join(d, "cgroup.procs"), str(pid))

    @property
    def oom_counter(self) -> str | None:
        """The file whose ``oom_kill`` line counts this sandbox's OOM kills."""
        if self.version == 2:
            return os.path.join(self.dirs[""], "memory.events")
        d = self.dirs.get("memory")
        return os.path.join(d, "memory.oom_control") if d else None

    def oom_kills(self) -> int | None:
        return read_oom_kills(self.oom_counter)

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs.values():
            with contextlib.suppress(OSError), open(os.path.join(d, "cgroup.procs")) as f:
                found.update(int(line) for line in f if line.strip())
        return found

    def kill(self) -> None:
        """SIGKILL every process in the sandbox's cgroup."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                _write(os.path.join(self.dirs[""], "cgroup.kill"), "1")
                return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove(self, timeout: float = REMOVE_TIMEOUT_S) -> None:
        """Kill what is left and remove every directory; idempotent. A cgroup that
        stays busy past ``timeout`` is reported (it cannot be removed while a
        process, even a dying one, is in it)."""
        deadline = time.monotonic() + timeout
        for controller, d in list(self.dirs.items()):
            while True:
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise CgroupUnavailable(f"cannot remove cgroup {d}: {exc.strerror}") from None
                    self.kill()
                    time.sleep(0.02)
                    continue
                break
            del self.dirs[controller]
