"""Starts, watches and restarts the session worker subprocesses of one router process.

Each shard has one slot run by one greenlet: spawn the worker (multiprocessing *spawn*
context, a duplex ``Pipe`` = socketpair per worker), wait for its first heartbeat, then
watch it — process sentinel, channel EOF, and a ``ping`` every ``heartbeat_interval`` that
must answer within ``heartbeat_timeout``. A worker's hub answers pings between requests, so a
worker busy in one long CPU-bound call (tokenizing a large prompt) misses them without being
hung: a missed ping only counts while the process makes no progress — it is stopped, or used
no CPU time since the last check (:class:`_Progress`, from ``/proc``) — or after
``busy_timeout`` of missed pings in a row. A dead or hung worker marks its shard down at
once (its requests get :class:`ShardUnavailable` -> 503 without waiting), is killed and
reaped, and is restarted with exponential backoff. Its in-memory sessions are gone; the
other shards never notice. A worker that cannot boot (it answers ``WorkerBootError`` and exits
with ``worker.EXIT_BOOT_ERROR``, e.g. a bad tokenizer path) is retried ``boot_attempts`` times
in a row at most; then its slot is ``FAILED``, with the reason its requests and ``/health``
report, and is never restarted (:class:`SlotState`).

Must be started after gevent's monkey-patching — in gunicorn's ``post_worker_init`` hook or
lazily on first use — never in the gunicorn master or at ``--preload``: the workers and their
sockets belong to the process that will drive them.
"""

from __future__ import annotations

import enum
import json
import logging
import multiprocessing
import multiprocessing.reduction
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gevent
import gevent.event
import gevent.os
from gevent import monkey
from gevent.socket import wait_read

from webapp import body_handoff, worker
from webapp.body_handoff import HandedBody
from webapp.errors import WebappError
from webapp.ipc import WORKER_BOOT_ERROR, Buffer, IpcChannelClosed, IpcError, IpcRemoteError, IpcTimeout, Op
from webapp.ipc_channel import IpcClient, IpcReply, open_socket
from webapp.settings import default

__all__ = ["ShardUnavailable", "SlotState", "Supervisor", "SupervisorConfig"]

log = logging.getLogger(__name__)

_STOP_GRACE = 5.0  # a worker gets this long to exit on EOF before SIGKILL


class ShardUnavailable(WebappError):
    """The worker owning ``shard`` is not serving (starting, dead, hung, stopped or failed)."""

    status = 503

    def __init__(self, shard: int, reason: str) -> None:
        super().__init__(f"session worker for shard {shard} is unavailable: {reason}")
        self.shard = shard
        self.reason = reason


@dataclass
class SupervisorConfig:
    workers: int
    core: dict[str, Any]  # keyword arguments of webapp.core.CoreConfig (plain data: no core import)
    # The router settings of webapp.settings.SETTINGS (defaults and docs there):
    startup_timeout: float = default("startup_timeout")  # spawn to first heartbeat
    heartbeat_interval: float = default("heartbeat_interval")
    heartbeat_timeout: float = default("heartbeat_timeout")  # no answer this long, no progress: hung
    busy_timeout: float = default("busy_timeout")  # ... and this long: hung even while using CPU
    boot_attempts: int = default("boot_attempts")  # failed boots in a row before the shard is failed
    restart_backoff: float = 0.1  # first restart delay, doubled per consecutive failure
    restart_backoff_max: float = 5.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")


class SlotState(enum.Enum):
    STARTING = "starting"  # spawned, its first heartbeat not answered yet
    READY = "ready"  # serving
    DOWN = "down"  # dead or hung: being reaped and restarted (503 meanwhile)
    STOPPED = "stopped"  # the supervisor is stopping
    FAILED = "failed"  # could not boot boot_attempts times in a row: never restarted (503)


@dataclass
class _Slot:
    shard: int
    state: SlotState = SlotState.STARTING
    reason: str = "starting"
    boot_failed: bool = False  # the current incarnation reported (or exited with) a boot error
    hung: bool = False  # the current incarnation stopped answering pings: no grace when reaped
    client: IpcClient | None = None
    process: Any = None
    pid: int | None = None
    restarts: int = 0
    config: dict[str, Any] | None = None  # the CoreConfig the worker runs with, as it reported it
    lost: gevent.event.Event = field(default_factory=gevent.event.Event)


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self._ctx = multiprocessing.get_context("spawn")
        self._slots = [_Slot(i) for i in range(config.workers)]
        self._greenlets: list[gevent.Greenlet] = []
        self._stopping = False
        self._started = False

    @property
    def workers(self) -> int:
        return self.config.workers

    def start(self) -> None:
        """Spawn every worker; returns at once (see :meth:`wait_ready`). Idempotent."""
        if self._started:
            return
        if not monkey.is_module_patched("socket"):
            # e.g. gunicorn's master at --preload: the workers and their sockets would belong to a
            # process that never drives them (and forks would inherit them)
            raise RuntimeError("start the session workers in the gevent-patched serving process "
                               "(gunicorn's post_worker_init), not before patching")
        self._started = True
        self._greenlets = [gevent.spawn(self._run_slot, slot) for slot in self._slots]

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every shard is ready; False if some are not within ``timeout``."""
        with gevent.Timeout(timeout, False):
            while not all(slot.state is SlotState.READY for slot in self._slots):
                gevent.sleep(0.02)
            return True
        return False

    def status(self) -> list[dict[str, Any]]:
        return [{"shard": s.shard, "state": s.state.value, "reason": s.reason, "restarts": s.restarts,
                 "pid": s.pid, "config": s.config} for s in self._slots]

    @property
    def takes_body_sockets(self) -> bool:
        """:meth:`request` takes ``body_socket``: every worker has a handoff channel."""
        return True

    def request(self, shard: int, meta: dict[str, Any], body: Buffer | Sequence[Buffer] = b"", *,
                timeout: float, chunk_timeout: float = 60.0, body_stream: Iterable[Buffer] | None = None,
                body_length: int | None = None, body_socket: HandedBody | None = None,
                body_timeout: float = 60.0) -> IpcReply:
        """One request to the worker owning ``shard`` (``body_stream``, ``body_length``: a
        streamed body; ``body_socket``, ``body_timeout``: a body the worker receives from the
        client's connection; see :meth:`IpcClient.request`).

        Raises:
            ShardUnavailable: the worker is not serving (at once, without waiting), or died
                while this request was in flight.
            IpcTimeout, IpcRemoteError, FrameTooLarge: see :meth:`IpcClient.request`.
        """
        self.start()
        slot = self._slots[shard]
        client = slot.client
        if slot.state is not SlotState.READY or client is None:
            raise ShardUnavailable(shard, slot.reason)
        try:
            return client.request(meta, body, timeout=timeout, chunk_timeout=chunk_timeout,
                                  body_stream=body_stream, body_length=body_length, body_socket=body_socket,
                                  body_timeout=body_timeout)
        except IpcChannelClosed as exc:
            raise ShardUnavailable(shard, f"worker lost mid-request ({exc.reason})") from exc

    def stop(self) -> None:
        """Close every channel (workers exit on EOF), reap them, SIGKILL stragglers."""
        if self._stopping:
            return
        self._stopping = True
        for slot in self._slots:
            if slot.state is not SlotState.FAILED:
                slot.state, slot.reason = SlotState.STOPPED, "server shutting down"
            if slot.client is not None:
                slot.client.close("server shutting down")
        # Each slot greenlet reaps its own worker on the way out; then sweep up the rest.
        gevent.killall(self._greenlets, block=True, timeout=_STOP_GRACE + 1.0)
        for slot in self._slots:
            if slot.process is not None:
                _reap(slot.process, _STOP_GRACE)

    # -- one slot -------------------------------------------------------------------------

    def _run_slot(self, slot: _Slot) -> None:
        backoff = self.config.restart_backoff
        boot_failures = 0
        while not self._stopping:
            served = self._run_worker(slot)
            if self._stopping:
                return
            if served:  # only consecutive failures to start back off
                backoff = self.config.restart_backoff
            boot_failures = boot_failures + 1 if slot.boot_failed else 0
            if boot_failures >= self.config.boot_attempts:
                # A respawn would fail the same way (a bad setting): say why, once, and stop.
                slot.state = SlotState.FAILED
                slot.reason = f"failed: the worker could not boot ({boot_failures} attempts): {slot.reason}"
                log.error("session worker for shard %d %s; not restarting it", slot.shard, slot.reason)
                return
            slot.restarts += 1
            log.warning("session worker for shard %d down (%s); restarting in %.1f s",
                        slot.shard, slot.reason, backoff)
            gevent.sleep(backoff)
            backoff = min(backoff * 2, self.config.restart_backoff_max)

    def _run_worker(self, slot: _Slot) -> bool:
        """Run one worker incarnation to its end; True if it became ready at some point."""
        cfg = self.config
        slot.state, slot.reason, slot.pid, slot.hung = SlotState.STARTING, "worker starting", None, False
        slot.boot_failed = False
        slot.lost = lost = gevent.event.Event()
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker.run, name=f"shinken-session-worker-{slot.shard}", daemon=True,
            args=(child_conn, slot.shard, cfg.workers, cfg.core, os.getpid()))
        process.start()
        assert process.pid is not None  # started
        _watch_child(process.pid)
        child_conn.close()  # only the worker may hold its end, or its death would not be EOF here
        slot.process, slot.pid = process, process.pid
        # The worker's end of its handoff channel (webapp.body_handoff) goes first on the pipe,
        # before any frame: the worker takes it before it starts reading frames.
        handoff, worker_handoff = body_handoff.open_pair()
        with worker_handoff:
            try:
                multiprocessing.reduction.send_handle(parent_conn, worker_handoff.fileno(), process.pid)
            except OSError:  # the worker died at once: its channel's EOF below says so
                pass
        sock = open_socket(os.dup(parent_conn.fileno()))
        parent_conn.close()
        client = IpcClient(sock, name=f"shard {slot.shard}",
                           on_close=lambda exc: self._mark_down(slot, lost, f"channel closed ({exc.reason})"),
                           handoff=open_socket(handoff.detach()))
        slot.client = client
        watcher = gevent.spawn(self._watch_sentinel, slot, process, lost)
        try:
            served = self._watch(slot, client, lost)
        finally:
            watcher.kill(block=False)
            client.close("worker replaced")
            _reap(process, 0.0 if slot.hung else 1.0)
        return served

    def _watch(self, slot: _Slot, client: IpcClient, lost: gevent.event.Event) -> bool:
        """Returns once the worker is lost (the slot is down by then): did it ever serve?"""
        cfg = self.config
        try:
            hello = client.request({"op": Op.PING, "config": True}, timeout=cfg.startup_timeout)
        except IpcTimeout:
            self._mark_down(slot, lost, f"hung: no heartbeat within the {cfg.startup_timeout} s startup timeout",
                            hung=True)
            return False
        except IpcRemoteError as exc:
            slot.boot_failed = exc.remote_type == WORKER_BOOT_ERROR
            self._mark_down(slot, lost, f"failed to boot: {exc.message}" if slot.boot_failed
                            else f"failed to start ({exc})")
            return False
        except IpcError as exc:
            self._mark_down(slot, lost, f"failed to start ({exc})")
            return False
        slot.state, slot.reason = SlotState.READY, "ready"
        slot.config = json.loads(hello.body).get("config") if hello.stream is None else None
        log.info("session worker for shard %d ready (pid %d)", slot.shard, slot.pid)
        progress = _Progress(slot.pid)
        missed_since: float | None = None
        while not lost.wait(cfg.heartbeat_interval):
            try:
                client.request({"op": Op.PING}, timeout=cfg.heartbeat_timeout)
            except IpcTimeout:
                now = time.monotonic()
                missed_since = now - cfg.heartbeat_timeout if missed_since is None else missed_since
                busy = progress.advanced()
                if busy and now - missed_since < cfg.busy_timeout:
                    log.warning("session worker for shard %d is busy (using CPU, %.1f s without a heartbeat)",
                             slot.shard, now - missed_since)
                    continue
                why = (f"busy for {now - missed_since:.0f} s without a heartbeat (busy_timeout {cfg.busy_timeout} s)"
                       if busy else f"no heartbeat within {cfg.heartbeat_timeout} s and no progress")
                self._mark_down(slot, lost, f"hung: {why}", hung=True)
            except IpcError as exc:
                self._mark_down(slot, lost, f"lost ({exc})")
            else:
                missed_since = None
                progress.advanced()  # a fresh reference for the next missed ping
        return True

    def _mark_down(self, slot: _Slot, lost: gevent.event.Event, reason: str, *, hung: bool = False) -> None:
        # The first signal wins (sentinel, EOF, failed heartbeat); from this instant the
        # shard answers 503 without waiting for the slot greenlet to wake up.
        if slot.lost is lost and slot.state is not SlotState.DOWN and slot.state is not SlotState.STOPPED:
            slot.state, slot.reason, slot.hung = SlotState.DOWN, reason, hung
        lost.set()

    def _watch_sentinel(self, slot: _Slot, process: Any, lost: gevent.event.Event) -> None:
        wait_read(process.sentinel)  # readable once the process is gone; killed with its slot
        code = process.exitcode  # None when SIGCHLD has not been processed yet
        if code == worker.EXIT_BOOT_ERROR:
            slot.boot_failed = True
        self._mark_down(slot, lost, "worker process exited" + (f" with code {code}" if code is not None else ""))


class _Progress:
    """Whether a process made progress since the last call: not stopped (or dead) and it used
    CPU time meanwhile. Linux ``/proc``; elsewhere it never reports progress (a missed ping
    is then a hang, as before)."""

    _STOPPED = frozenset("TtZX")

    def __init__(self, pid: int | None) -> None:
        self._path = f"/proc/{pid}/stat"
        self._cpu = self._sample()[1]

    def _sample(self) -> tuple[str, int | None]:
        try:
            with open(self._path, "rb") as f:
                # the command name (field 2) may hold spaces and parens: split after its last ')'
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            return "X", None
        return fields[0].decode(), int(fields[11]) + int(fields[12])  # state, utime + stime (ticks)

    def advanced(self) -> bool:
        state, cpu = self._sample()
        previous, self._cpu = self._cpu, cpu
        return state not in self._STOPPED and cpu is not None and previous is not None and cpu > previous


def _watch_child(pid: int) -> None:
    # Under patching, gevent's SIGCHLD handler reaps every child; unless it watches this pid
    # (before the hub runs again) multiprocessing's waitpid would never see the exit status.
    if monkey.is_module_patched("os"):
        gevent.os._watch_child(pid)


def _reap(process: Any, grace: float) -> None:
    """Wait up to ``grace`` s for ``process`` to exit, then SIGKILL it; never blocks the hub.

    Idempotent: a slot greenlet and :meth:`Supervisor.stop` may both reap the same worker.
    """
    if grace > 0:
        try:
            wait_read(process.sentinel, timeout=grace)
        except TimeoutError:
            pass
    if process.exitcode is None:
        process.kill()
        try:
            wait_read(process.sentinel, timeout=_STOP_GRACE)
        except TimeoutError:
            log.error("session worker pid %d survived SIGKILL for %s s", process.pid, _STOP_GRACE)
            return
    process.join(0)  # idempotent; the sentinel fd is released when the Process is collected
