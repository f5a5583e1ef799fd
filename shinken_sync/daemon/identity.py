"""Who runs what inside an isolated sandbox: the daemon apart from the agent.

In an isolated sandbox (``shinken_sync.providers.isolated``) shinkend is the
user namespace's uid 0 (an unprivileged uid on the host) holding a few
capabilities inside it, and every process the agent gets -- ``exec`` children,
and the programs a display backend launches for it -- runs as another,
capability-less uid (``--exec-user UID:GID``). So the agent cannot ptrace the
daemon nor read its ``/proc/PID/{environ,mem,fd}`` (different uid, no
``CAP_SYS_PTRACE``, and the daemon is non-dumpable), cannot signal it (no
``CAP_KILL``) and cannot enter its socket directory (mode 0700).

Memory: the daemon raises its own ``oom_score_adj`` to 1000, so when the
sandbox's memory cgroup runs out the kernel's OOM killer picks the daemon
first; its exit ends the sandbox's PID namespace (every process in it is
killed), and the provider reports the death as an OOM kill. A sandbox out of
memory ends whole, like cgroup v2's ``memory.oom.group``, on v1 too: a desktop
missing a random half (the X server, the browser) is no state to continue an
episode from. Children lower their score back to 0 (allowed without privilege
down to the floor the provider set) through ``choom`` before they drop to the
agent's uid, so a large agent process never shields itself behind the daemon.

:func:`agent` is the process-wide setting, configured once by
``daemon.server.main``; ``None`` (no ``--exec-user``) keeps today's behaviour:
children run as the daemon does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["AgentUser", "agent", "chown_to_agent", "harden_daemon", "set_agent"]

_PR_SET_DUMPABLE = 4
#: The daemon's OOM score in an isolated sandbox: the first victim (see the module docstring).
DAEMON_OOM_SCORE_ADJ = 1000


@dataclass(frozen=True)
class AgentUser:
    """The uid/gid (inside the sandbox) the agent's processes run as, and their home."""

    uid: int
    gid: int
    home: str
    name: str = "agent"

    def popen_options(self) -> dict[str, Any]:
        """``subprocess.Popen`` / ``asyncio.create_subprocess_exec`` options that start a
        child as this user, with no supplementary groups (it loses every capability)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def environment(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` run with its OOM score back at 0 (``choom``, util-linux), so that the
        daemon stays the OOM killer's first choice."""
        return ["choom", "-n", "0", "--", *argv]


_agent: AgentUser | None = None


def set_agent(user: AgentUser | None) -> None:
    global _agent
    _agent = user


def agent() -> AgentUser | None:
    """The agent's identity, or None when children run as the daemon (no ``--exec-user``)."""
    return _agent


def parse_exec_user(text: str) -> tuple[int, int]:
    """``UID:GID`` (or ``UID``, gid = uid) as two integers >= 1."""
    uid_text, _, gid_text = text.partition(":")
    try:
        uid, gid = int(uid_text), int(gid_text or uid_text)
    except ValueError:
        raise ValueError(f"--exec-user must be UID[:GID], not {text!r}") from None
    if uid < 1 or gid < 1:
        raise ValueError(f"--exec-user must not be root (uid/gid 0), not {text!r}")
    return uid, gid


def harden_daemon(oom_first: bool) -> None:
    """Make this process non-dumpable: its ``/proc`` files become root's and ptrace
    needs ``CAP_SYS_PTRACE``, so no other uid reads its memory, environment or fds
    (the bearer token lives there). With ``oom_first``, raise the OOM score too."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    if oom_first:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(DAEMON_OOM_SCORE_ADJ))


def prepare_home(user: AgentUser) -> None:
    """Create the agent's home (mode 0700, owned by it) if missing."""
    os.makedirs(user.home, mode=0o700, exist_ok=True)
    os.chown(user.home, user.uid, user.gid)


def chown_to_agent(fd_or_path: int | str) -> None:
    """Give a file the daemon just created to the agent, so the agent can change it
    (the file verbs run with the daemon's rights). No agent: nothing to do."""
    user = _agent
    if user is None:
        return
    if isinstance(fd_or_path, int):
        os.fchown(fd_or_path, user.uid, user.gid)
    else:
        os.chown(fd_or_path, user.uid, user.gid, follow_symlinks=False)
