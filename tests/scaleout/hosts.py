"""Several "hosts" on this one machine: Linux network namespaces on one bridge.

:class:`Hosts` creates ``n`` namespaces, each with a veth pair whose outer end joins one
bridge, and gives namespace ``i`` the address ``10.<a>.<b>.<i+1>`` of a private /24 that
exists only inside those namespaces (the bridge itself has no address, so the machine's own
network never carries or sees this traffic). Names carry a random tag, so parallel runs do
not collide. :meth:`Hosts.close` kills every process still in the namespaces (``ip netns
pids``: exactly what ran there, nothing else on the machine), then deletes the namespaces,
veths and bridge; it runs on failure too (a context manager, and the pytest fixture's
finaliser). Needs root (``ip netns add``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *argv], check=check, capture_output=True, text=True, timeout=30)


def can_make_hosts() -> str | None:
    """None when namespaces can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "needs root: the scale-out tests create network namespaces (ip netns add)"
    if shutil.which("ip") is None and shutil.which("ip", path="/usr/sbin:/sbin") is None:
        return "needs iproute2 (the ip command); .ci/run installs it"
    return None


@dataclass
class Hosts:
    n: int
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    namespaces: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # A private /24 picked at random; it only exists inside this run's namespaces.
        a, b = 100 + secrets.randbelow(100), secrets.randbelow(250)
        self.subnet = f"10.{a}.{b}"
        self.bridge = f"shb{self.tag}"
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i in range(self.n):
                self.add_host()
        except BaseException:
            self.close()
            raise

    def add_host(self) -> int:
        i = len(self.namespaces)
        ns, outer, inner = f"shk{self.tag}{i}", f"sh{self.tag}{i}o", f"sh{self.tag}{i}i"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "master", self.bridge, "up")
        address = f"{self.subnet}.{i + 1}"
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.addresses.append(address)
        return i

    def argv(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.argv(i, argv), **kwargs)

    def run(self, i: int, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(i, argv), check=kwargs.pop("check", False), **kwargs)

    def pids(self, i: int) -> list[int]:
        out = _ip("netns", "pids", self.namespaces[i], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Every process in host ``i`` gets ``sig``: the host "loses power"."""
        for _ in range(5):  # a dying parent may still spawn; repeat until the namespace is empty
            pids = self.pids(i)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(0.2)

    def close(self) -> None:
        for i in range(len(self.namespaces)):
            with contextlib.suppress(Exception):
                self.kill_host(i, signal.SIGTERM)
            with contextlib.suppress(Exception):
                self.kill_host(i, signal.SIGKILL)
        for i, ns in enumerate(self.namespaces):
            _ip("link", "del", f"sh{self.tag}{i}o", check=False)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        self.namespaces = []

    def __enter__(self) -> Hosts:  # noqa: PYI034 (no typing.Self on 3.10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
