"""The one /proc reader of the benches and the tests (Linux): process state, CPU, memory, threads.

Benches import it as ``procfs`` (their own directory is on ``sys.path``); tests import it as
``bench.procfs`` (the checkout is). Measurement and liveness helpers only: the product reads
/proc where it must in its own modules (the providers' OOM counter).
"""

from __future__ import annotations

import os

__all__ = ["CLK_TCK", "alive", "cpu_seconds", "fd_count", "loadavg", "minor_faults", "state", "status",
           "status_bytes", "thread_count", "tree_cpu", "tree_pids"]

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int | str) -> list[str]:
    """``/proc/PID/stat`` after the command name (which may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].decode().split()


def state(pid: int | str) -> str | None:
    """The process's state letter (``R``, ``S``, ``Z``...), None once it is gone."""
    try:
        return _stat_fields(pid)[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def alive(pid: int | str) -> bool:
    """True while ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    return state(pid) not in (None, "Z")


def cpu_seconds(pid: int | str = "self", gone: float | None = None) -> float:
    """utime + stime of a process, its threads included; ``gone`` when it no longer exists
    (None: raise FileNotFoundError)."""
    try:
        fields = _stat_fields(pid)
    except FileNotFoundError:
        if gone is None:
            raise
        return gone
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def minor_faults(pid: int | str = "self", gone: int | None = None) -> int:
    """Minor page faults of a process so far, its threads included; ``gone`` when it no longer
    exists (None: raise FileNotFoundError), as :func:`cpu_seconds`."""
    try:
        fields = _stat_fields(pid)
    except FileNotFoundError:
        if gone is None:
            raise
        return gone
    return int(fields[7])


def status(pid: int | str = "self") -> dict[str, str]:
    """``/proc/PID/status`` as ``{field: value}`` (values stripped; ``VmRSS: "123 kB"``)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def status_bytes(pid: int | str, key: str) -> int | None:
    """A ``kB`` field of ``/proc/PID/status`` in bytes (``VmRSS``, ``VmHWM``); None if the
    process is gone or has no such field (a zombie has no memory)."""
    try:
        value = status(pid).get(key)
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(value.split()[0]) * 1024 if value else None


def thread_count(pid: int | str = "self") -> int:
    """OS threads of a process (under gevent, ``threading.active_count()`` counts greenlets)."""
    return len(os.listdir(f"/proc/{pid}/task"))


def fd_count(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def loadavg() -> float:
    """The machine's 1-minute load average: other work competing for the cores."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def tree_pids(root: int) -> list[int]:
    """``root`` and every descendant alive now (from /proc's ppid fields)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_cpu(root: int) -> float:
    """User + system seconds of ``root`` and every descendant alive now (one that exits
    meanwhile counts 0)."""
    return sum(cpu_seconds(pid, gone=0.0) for pid in tree_pids(root))
