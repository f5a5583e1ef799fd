"""Session server instances and nginx in the namespaces of :class:`~tests.scaleout.hosts.Hosts`.

Each instance is ``shinken-session-server --instance TAG`` bound to its host's address; nginx
runs with its own prefix, config, pid and logs in a temporary folder (never the system's),
with the config ``shinken-session-server nginx-config --full`` prints, and listens on its
host's address and on a unix socket: the socket is how a test process outside the
namespaces talks to it (filesystem, not network).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shinken_sync.childproc import ReadyLineError, parse_ready_line, read_ready_line
from tests.scaleout.hosts import Hosts
from tests.support import sigkill_tree
from webapp.serve import server_argv

NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
NGINX_PORT = 8080  # inside nginx's own namespace


@dataclass
class Instance:
    tag: str
    proc: subprocess.Popen
    url: str

    def kill(self) -> None:
        """SIGKILL the instance's whole tree at once (launcher, gunicorn, router, workers, backend)."""
        sigkill_tree(self.proc)


def start_instance(hosts: Hosts, i: int, tag: str, workers: int = 1) -> Instance:
    argv = server_argv(workers, None, f"{hosts.addresses[i]}:0", "--instance", tag)
    proc = hosts.popen(i, argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                       start_new_session=True)
    try:
        line = read_ready_line(proc.stdout.fileno(), 120)
    except ReadyLineError as exc:
        line = repr(exc).encode()
    ready = parse_ready_line(line) or {}
    if not ready.get("ready"):
        proc.kill()
        raise RuntimeError(f"session server {tag} did not start: {line!r}")
    return Instance(tag, proc, ready["url"])


class Nginx:
    def __init__(self, hosts: Hosts, i: int, instances: list[Instance]):
        self.prefix = Path(tempfile.mkdtemp(prefix="shinken-nginx-"))
        self.prefix.chmod(0o755)  # nginx's workers run as nobody
        self.socket = self.prefix / "nginx.sock"
        self.url = f"http://{hosts.addresses[i]}:{NGINX_PORT}"
        specs = [f"{inst.tag}={inst.url.removeprefix('http://')}" for inst in instances]
        conf = self.prefix / "nginx.conf"
        subprocess.run([sys.executable, "-m", "webapp.serve", "nginx-config", *specs,
                        "--listen", f"{hosts.addresses[i]}:{NGINX_PORT}", "--listen", f"unix:{self.socket}",
                        "--full", str(self.prefix), "--out", str(conf)], check=True)
        self.proc = hosts.popen(i, [NGINX, "-p", str(self.prefix), "-c", str(conf)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start: {self.proc.stderr.read()!r}")
            time.sleep(0.05)

    def access_log(self) -> list[str]:
        path = self.prefix / "access.log"
        return path.read_text().splitlines() if path.exists() else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.prefix, ignore_errors=True)


@contextlib.contextmanager
def nginx_front(hosts: Hosts, tags: tuple[str, ...]) -> Iterator[tuple[Nginx, list[Instance]]]:
    """Instance ``tags[i]`` on host i, nginx on host 0 in front of them all; all stopped after."""
    instances: list[Instance] = []
    nginx = None
    try:
        instances = [start_instance(hosts, i, tag) for i, tag in enumerate(tags)]
        nginx = Nginx(hosts, 0, instances)
        yield nginx, instances
    finally:
        if nginx is not None:
            nginx.stop()
        for inst in instances:
            if inst.proc.poll() is None:
                inst.kill()


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over nginx's unix socket (from outside the namespaces)."""

    def __init__(self, path: Path, timeout: float = 120.0):
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def request(conn: http.client.HTTPConnection, method: str, path: str, body: object = None) -> tuple[int, dict]:
    payload = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=payload, headers={"Content-Type": "application/json"} if payload else {})
    reply = conn.getresponse()
    data = reply.read()
    try:
        return reply.status, json.loads(data)
    except ValueError:
        return reply.status, {"raw": data.decode(errors="replace")}
