"""Is the inference backend there, and keeping the embedded one there.

Once the embedded reference backend died, every chat was 502 forever while ``/health``
stayed 200. Two parts:

- :func:`probe_backend`: ``GET {backend}/health``; any HTTP answer means the backend is
  reachable (a real engine's ``/health`` may be 404), a refused or silent connection means it
  is not. Both apps' ``/health`` report it and answer 503 while it is unreachable.
- :class:`SupervisedBackend`: the launcher's embedded backend, restarted on the same address
  whenever its process exits (with backoff), so the URL the workers hold stays valid.
"""

from __future__ import annotations

import http.client
import logging
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

__all__ = ["BACKEND_PROBE_TIMEOUT", "SupervisedBackend", "probe_backend"]

log = logging.getLogger(__name__)

BACKEND_PROBE_TIMEOUT = 2.0
_POLL = 0.2
_BACKOFF_MAX = 5.0


def probe_backend(url: str, timeout: float = BACKEND_PROBE_TIMEOUT) -> str | None:
    """None if the backend at ``url`` answers HTTP at all; else why it is unreachable."""
    parts = urlsplit(url)
    conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_class(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path.rstrip("/") + "/health")
        conn.getresponse().read(4096)
    except (OSError, http.client.HTTPException) as exc:
        return f"backend {url} unreachable: {exc!r}"
    finally:
        conn.close()
    return None


class SupervisedBackend:
    """A backend process kept running: ``start(bind)`` starts one (``bind`` is None the first
    time, then the first one's ``host:port``) and returns an object with ``url``, ``proc``
    (a ``subprocess.Popen``) and ``close()`` — what :func:`webapp.reference_backend.start_reference_backend`
    returns. A watcher thread restarts it whenever its process exits, until :meth:`close`.
    """

    def __init__(self, start: Callable[[str | None], Any]) -> None:
        self._start = start
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.current = start(None)
        parts = urlsplit(self.current.url)
        self.url = self.current.url
        self._bind = f"{parts.hostname}:{parts.port}" if ":" not in (parts.hostname or "") \
            else f"[{parts.hostname}]:{parts.port}"
        self.restarts = 0
        self._watcher = threading.Thread(target=self._watch, name="backend-supervisor", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        backoff = 0.1
        while not self._closed.wait(_POLL):
            code = self.current.proc.poll()
            if code is None:
                backoff = 0.1
                continue
            log.warning("embedded backend exited with code %s; restarting it on %s", code, self._bind)
            try:
                replacement = self._start(self._bind)
            except (OSError, RuntimeError) as exc:  # port still held, exited early, slow start (TimeoutError)
                log.error("embedded backend failed to restart (%r); retrying in %.1f s", exc, backoff)
                self._closed.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
                continue
            with self._lock:
                if self._closed.is_set():
                    replacement.close()
                    return
                self.current.close()  # reaps the dead one
                self.current = replacement
                self.restarts += 1

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            self.current.close()
        self._watcher.join(timeout=_POLL * 5 + 1)
