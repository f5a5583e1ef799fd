"""Records journal benchmark: records GET by sendfile, chats under a GET, worker memory
on a production-shaped run, and what a journaled turn costs.

    PYTHONPATH=. python bench/records_journal.py [--quick] [--only get,load,prod,commit] [--json OUT]

Prints, against its targets (speed targets live here, never in tests):

1. ``get``: ``GET /sessions/{id}`` of a ~4 GiB session (``--size-gib``, ``--turn-mib`` per turn)
   from ``shinken-session-server --workers 2 --data-dir DIR``, read on loopback by a client that
   ``recv_into``s a 4 MiB buffer and discards it, alternated in the same run with the physical
   floor: a raw ``os.sendfile`` of the GET's byte count (the journal file, repeated: it is
   smaller than the records, which repeat each turn's R3) over a loopback TCP socket to the
   same reader. The first GET of the fresh session (which computes the session metadata) is
   printed on its own. MiB/s and the ratio -> target >= 0.8x. Worker and router RSS during the GETs;
   the server's CPU seconds and minor page faults per GET (a heap given back and faulted in again
   shows there, not in the RSS).
2. ``load``: the same GET while 64 clients chat on other sessions of the same server, half of
   them on the big session's shard (``webapp.sharding.shard_for``), each pausing ``--think-ms``
   between chats: GET MiB/s vs the idle floor (target >= 0.5x; the floor under the same chats
   is printed too) and the chat p50/p99 while a GET is in flight vs the same chats with no GET
   -> target p99 within 1.5x. Windows alternate: no GET, GETs back to back, sendfile floors
   back to back (the control: the same bytes moved on loopback without the server); a chat
   counts for the window it started and ended in.
3. ``prod``: N sessions x T turns x ~64 MiB per turn (default 8 x 50, ~25 GiB on disk), all
   sessions at once, every turn must answer 200, then every session is fetched (bytes read ==
   Content-Length). ``VmRSS`` of every ``shinken-session-worker`` (descendants of the server)
   sampled every 100 ms throughout -> target max < 1 GiB; disk used by the data dir.
4. ``commit``: chat latency p50/p99 with small records (no R3) for: the tree before the
   journal (``--baseline-commit``, extracted with ``git archive`` into the temp dir and run as
   its own server), the journal with fsync off, and with ``--fsync``; the three servers are up
   at once and the same closed-loop load (1 client: latency; 16: a busy server) runs on each in
   turn, rotated over rounds.

Big records come from the embedded reference backend's R3 knob (``--reference-r3-layers L
--reference-r3-topk K``): each reply carries base64 of (prompt + completion - 1) x L x K int32.
The byte tokenizer makes a prompt of B bytes about B tokens, so each big session opens with one
user message of ``turn_bytes / (L * K * 16 / 3)`` bytes and every turn's reply then carries about
``--turn-mib`` of R3 (small chats on the same server get ~``L * K * 16 / 3`` bytes per token).

Everything this bench writes (journals, server logs, the baseline tree) goes under one
``tempfile.mkdtemp`` directory (``$TMPDIR``), deleted at the end whatever happens (a SIGTERM
too); only loopback sockets are used. Everything shares the machine's cores: read ratios
measured side by side in one run before absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import procfs
from procfs import CLK_TCK
from rawhttp import Http, url_addr

from shinken_sync.stats import percentile

MiB = 1024**2
GiB = 1024**3
READ_BUF = 4 * MiB  # the GET client's recv_into buffer
JOURNAL_FLAG = "--data-dir"
FSYNC_FLAG = "--fsync"
JOURNAL_PATH = "sessions/{sid}.journal"
WORKER_TITLE = "shinken-session-worker"
SCRIPT = Path(__file__).resolve()
HERE = SCRIPT.parent
REPO = HERE.parent


@dataclass
class GetResult:
    status: int
    length: int  # Content-Length
    got: int  # body bytes read
    seconds: float  # connect to last byte
    start: float  # time.monotonic() at connect
    end: float
    head: bytes = b""  # first bytes of the body
    tail: bytes = b""  # last bytes of the body

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.got == self.length

    @property
    def mib_s(self) -> float:
        return self.got / self.seconds / MiB


def read_get(addr: tuple[str, int], path: str, buf: bytearray) -> GetResult:
    """One ``GET path`` on a fresh connection; the body is read with ``recv_into(buf)`` and
    discarded (the first and last 64 bytes are kept for a sanity check)."""
    start = time.monotonic()
    sock = socket.create_connection(addr, timeout=900)
    try:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode())
        view = memoryview(buf)
        have = 0
        while (end_of_head := bytes(view[:have]).find(b"\r\n\r\n")) < 0:
            n = sock.recv_into(view[have:], 64 * 1024)
            if n == 0:
                raise ConnectionError(f"GET {path}: closed before the headers ({have} bytes)")
            have += n
        head_text = bytes(view[:end_of_head]).decode("latin-1")
        status = int(head_text.split()[1])
        match = re.search(r"(?im)^content-length:\s*(\d+)", head_text)
        length = int(match.group(1)) if match else -1
        got = have - end_of_head - 4
        first = bytes(view[end_of_head + 4 : min(have, end_of_head + 4 + 64)])
        last = bytes(view[max(end_of_head + 4, have - 64) : have])
        while length < 0 or got < length:
            n = sock.recv_into(view, READ_BUF)
            if n == 0:
                break
            got += n
            if len(first) < 64:
                first += bytes(view[: min(n, 64 - len(first))])
            last = (last + bytes(view[max(0, n - 64) : n]))[-64:]
        end = time.monotonic()
        view.release()
        return GetResult(status, length, got, end - start, start, end, first, last)
    finally:
        sock.close()


class SendfileFloor:
    """The physical floor: a thread answering every connection with an HTTP head and then
    ``os.sendfile`` of one file, read by the same :func:`read_get` as the session server.

    ``length``: the bytes sent, the file over again as often as it takes (default: the file's
    size). A records GET serves each record's whole R3, where the journal keeps each turn's
    new rows once (packed), so its body is several times the journal: the floor moves the
    GET's own byte count, or a short transfer's start-up would count against the floor only."""

    def __init__(self, path: Path, length: int | None = None) -> None:
        self.path = path
        self.length = length
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.addr = self.listener.getsockname()
        self._thread = threading.Thread(target=self._serve, name="sendfile-floor", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            try:
                request = b""
                while b"\r\n\r\n" not in request:
                    piece = conn.recv(4096)
                    if not piece:
                        break
                    request += piece
                with open(self.path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    total = self.length if self.length is not None else size
                    conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {total}\r\n"
                                 f"Content-Type: application/json\r\n\r\n".encode())
                    done = 0
                    while done < total:
                        offset = done % size
                        sent = os.sendfile(conn.fileno(), f.fileno(), offset, min(size - offset, total - done))
                        if sent == 0:
                            break
                        done += sent
            except OSError:
                pass
            finally:
                conn.close()

    def get(self, buf: bytearray) -> GetResult:
        return read_get(self.addr, "/", buf)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(10)


# -- servers and their processes ---------------------------------------------------------------

def start_server(tmp: Path, name: str, workers: int, extra: list[str], pythonpath: Path) -> object:
    from webapp.serve import start_session_server

    env = {k: v for k, v in os.environ.items() if not k.startswith("SHINKEN_")}
    env["PYTHONPATH"] = str(pythonpath)
    # A guard: a data directory left to its default would land here, never in $HOME (the bench
    # also runs from inside ``tmp``, so ``python -m`` finds ``pythonpath``'s webapp, not the cwd's).
    env["XDG_STATE_HOME"] = str(tmp / f"state-{name}")
    # wait_ready (in it) stops the server itself when it does not get ready
    return start_session_server(workers, None, "127.0.0.1:0", *extra, log_path=tmp / f"{name}.log", env=env)


def log_tail(tmp: Path, name: str, chars: int = 3000) -> str:
    path = tmp / f"{name}.log"
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def worker_processes(server_pid: int) -> tuple[list[int], list[int]]:
    """(session worker pids, their parents = the router process) among the server's descendants."""
    import psutil

    workers, routers = [], set()
    try:
        for proc in psutil.Process(server_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if WORKER_TITLE in " ".join(proc.cmdline()):
                    workers.append(proc.pid)
                    routers.add(proc.ppid())
    except psutil.Error:
        pass
    return sorted(workers), sorted(routers)


def vm_rss(pid: int) -> int | None:
    return procfs.status_bytes(pid, "VmRSS")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (0 if it is gone)."""
    return procfs.cpu_seconds(pid, gone=0.0)


def server_cost(pids: list[int]) -> tuple[float, int]:
    """CPU seconds and minor page faults of the server's processes so far (the GET's own cost:
    a page faulted in is a page the server's allocator gave back and took again)."""
    return sum(cpu_seconds(pid) for pid in pids), sum(procfs.minor_faults(pid) for pid in pids)


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle (all cores; /proc/stat)."""
    with open("/proc/stat", "rb") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    return (sum(values) - values[3] - values[4]) / CLK_TCK  # less idle and iowait


class CpuMeter:
    """CPU seconds per role (router, session workers, backend, chat load, this process, the
    whole machine) accumulated over labelled windows: cores busy = seconds / window length."""

    def __init__(self, server_pid: int, extra: dict[str, int]) -> None:
        import psutil

        workers, routers = worker_processes(server_pid)
        backends = []
        with contextlib.suppress(psutil.Error):
            backends = [p.pid for p in psutil.Process(server_pid).children(recursive=True)
                        if "reference_backend" in " ".join(p.cmdline())]
        roles = {"router": routers, "workers": workers, "backend": backends, "bench": [os.getpid()],
                 **{k: [v] for k, v in extra.items()}}
        # Only roles that have processes: at --workers 0 there are no session workers (the
        # router serves every session itself), and a "workers 0.00" column read as idle workers.
        self.roles = {role: pids for role, pids in roles.items() if pids}
        self.busy: dict[str, dict[str, float]] = {}
        self.seconds: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        now = {role: sum(cpu_seconds(pid) for pid in pids) for role, pids in self.roles.items()}
        now["machine"] = machine_busy_seconds()
        return now

    @contextlib.contextmanager
    def window(self, label: str) -> Iterator[None]:
        t0, before = time.monotonic(), self._now()
        try:
            yield
        finally:
            after = self._now()
            self.seconds[label] = self.seconds.get(label, 0.0) + time.monotonic() - t0
            acc = self.busy.setdefault(label, {})
            for role, value in after.items():
                acc[role] = acc.get(role, 0.0) + value - before[role]

    def cores(self) -> dict[str, dict[str, float]]:
        return {label: {role: round(v / self.seconds[label], 2) for role, v in acc.items()}
                for label, acc in self.busy.items()}


class RssSampler(threading.Thread):
    """Every ``interval`` s: VmRSS of each session worker and of the router; the max per phase."""

    def __init__(self, server_pid: int, interval: float = 0.1) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.server_pid, self.interval = server_pid, interval
        self.phase = "start"
        self.max_worker: dict[str, int] = {}
        self.max_router: dict[str, int] = {}
        self.worker_sets: list[list[int]] = []  # every distinct set of worker pids seen (restarts)
        self.samples = 0
        self._halt = threading.Event()

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def run(self) -> None:
        workers: list[int] = []
        routers: list[int] = []
        tick = 0
        while not self._halt.is_set():
            if tick % 20 == 0 or not workers:
                workers, routers = worker_processes(self.server_pid)
                if workers and (not self.worker_sets or self.worker_sets[-1] != workers):
                    self.worker_sets.append(workers)
            tick += 1
            phase = self.phase
            for pid in workers:
                rss = vm_rss(pid)
                if rss is not None:
                    self.max_worker[phase] = max(self.max_worker.get(phase, 0), rss)
            for pid in routers:
                rss = vm_rss(pid)
                if rss is not None:
                    self.max_router[phase] = max(self.max_router.get(phase, 0), rss)
            self.samples += 1
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)

    def worker_max(self, *phases: str) -> int:
        return max((v for k, v in self.max_worker.items() if not phases or k in phases), default=0)

    def router_max(self, *phases: str) -> int:
        return max((v for k, v in self.max_router.items() if not phases or k in phases), default=0)

    @property
    def restarts(self) -> int:
        return max(0, len(self.worker_sets) - 1)


# -- building big sessions --------------------------------------------------------------------

def new_session(http: Http, shard: int | None, shards: int) -> str:
    """A fresh session id, on ``shard`` (None: any): create, and delete those on other shards."""
    from webapp.sharding import shard_for

    while True:
        status, body = http.request("POST", "/sessions")
        if status != 200:
            raise RuntimeError(f"POST /sessions: {status} {body[:300]!r}")
        sid = json.loads(body)["session_id"]
        if shard is None or shard_for(sid, shards) == shard:
            return sid
        http.request("DELETE", f"/sessions/{sid}")


def opening_bytes(turn_bytes: int, layers: int, topk: int) -> int:
    """The size of a big session's first user message such that each reply carries ~turn_bytes
    of R3 (byte tokenizer: one token per byte; base64 of 4-byte ints: 16/3 bytes per int)."""
    return max(256, int(turn_bytes * 3 / (16 * layers * topk)))


@dataclass
class Build:
    sid: str
    turns: int
    seconds: float
    latencies: list[float]
    failures: list[str] = field(default_factory=list)


def build_session(url: str, sid: str, turns: int, first_bytes: int, stop: threading.Event | None = None) -> Build:
    """Run ``turns`` chat turns on ``sid``: an opening user message of ``first_bytes`` bytes, then
    short ones, each with the assistant's actual reply appended (an append-only history)."""
    phrase = "the quarterly report lists every open ticket; select the third row and open it. "
    opening = (f"[{sid}] " + phrase * (first_bytes // len(phrase) + 1))[:first_bytes]
    messages: list[dict] = [{"role": "user", "content": opening}]
    http = Http(url)
    latencies: list[float] = []
    failures: list[str] = []
    start = time.monotonic()
    try:
        for turn in range(turns):
            if stop is not None and stop.is_set():
                break
            if turn:
                messages.append({"role": "user", "content": f"turn {turn}: click the OK button"})
            body = json.dumps({"messages": messages}).encode()
            t0 = time.monotonic()
            status, reply = http.request("POST", f"/sessions/{sid}/v1/chat/completions", body)
            latencies.append(time.monotonic() - t0)
            if status != 200:
                failures.append(f"turn {turn}: {status} {reply[:300]!r}")
                break
            messages.append({"role": "assistant", "content": json.loads(reply)["choices"][0]["message"]["content"]})
    finally:
        http.close()
    return Build(sid, len(latencies) - len(failures), time.monotonic() - start, latencies, failures)


def disk_used(path: Path) -> tuple[int, int, int]:
    """(bytes allocated, sum of file sizes, files) under ``path``."""
    allocated = size = files = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                allocated += st.st_blocks * 512
                size += st.st_size
                files += 1
    return allocated, size, files


def fs_type(path: Path) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mount = parts[1]
            if (str(path) + "/").startswith(mount.rstrip("/") + "/") and len(mount) >= len(best):
                best, kind = mount, f"{parts[2]} ({parts[0]} on {mount})"
    return kind


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


# -- the chat load (a gevent-patched subprocess of this script) -----------------------------------

def chatload_main(config_path: str) -> None:
    """Clients chatting on their own sessions until stdin closes (or ``chats_per_client`` each).

    Each client keeps one session for ``turns_per_session`` turns (the assistant's replies
    appended), then deletes it and takes a new one on its shard. Writes every chat as
    ``[start, end, client, status]`` (``time.monotonic()``: the same clock as the parent's).
    """
    from gevent import monkey

    monkey.patch_all()
    import gevent
    import gevent.event
    from gevent.socket import wait_read

    cfg = json.loads(Path(config_path).read_text())
    url, shards, plan = cfg["url"], cfg["shards"], cfg["plan"]
    think, per_session, limit = cfg["think_s"], cfg["turns_per_session"], cfg["chats_per_client"]
    chats: list[list] = []
    errors: list[str] = []
    stop = gevent.event.Event()
    go = gevent.event.Event()
    ready = [0]
    all_ready = gevent.event.Event()

    def client(i: int) -> None:
        shard = plan[i]
        http = Http(url)
        try:
            sid = new_session(http, shard, shards)
            ready[0] += 1
            if ready[0] == len(plan):
                all_ready.set()
            go.wait()
            gevent.sleep(random.random() * max(think, 0.01))  # spread the first wave
            messages: list[dict] = []
            done = 0
            while not stop.is_set() and (not limit or done < limit):
                if len(messages) >= 2 * per_session:
                    http.request("DELETE", f"/sessions/{sid}")
                    sid, messages = new_session(http, shard, shards), []
                messages.append({"role": "user", "content": f"c{i} t{done}: click the OK button"})
                body = json.dumps({"messages": messages}).encode()
                t0 = time.monotonic()
                status, reply = http.request("POST", f"/sessions/{sid}/v1/chat/completions", body)
                chats.append([t0, time.monotonic(), i, status])
                done += 1
                if status != 200:
                    errors.append(f"client {i}: {status} {reply[:200]!r}")
                    http.request("DELETE", f"/sessions/{sid}")
                    sid, messages = new_session(http, shard, shards), []
                else:
                    messages.append({"role": "assistant",
                                     "content": json.loads(reply)["choices"][0]["message"]["content"]})
                if think:
                    gevent.sleep(think)
            http.request("DELETE", f"/sessions/{sid}")
        except Exception as exc:  # noqa: BLE001 (reported, not fatal for the other clients)
            errors.append(f"client {i}: {exc!r}")
        finally:
            http.close()

    def watch_stdin() -> None:
        while True:
            wait_read(sys.stdin.fileno())
            if not os.read(sys.stdin.fileno(), 4096):
                stop.set()
                return

    gevent.spawn(watch_stdin)
    jobs = [gevent.spawn(client, i) for i in range(len(plan))]
    all_ready.wait(300)
    print("ready", flush=True)
    go.set()
    gevent.joinall(jobs)
    Path(cfg["out"]).write_text(json.dumps({"chats": chats, "errors": errors, "plan": plan}))
    print("done", flush=True)


class ChatLoad:
    def __init__(self, tmp: Path, url: str, plan: list[int | None], shards: int, think_s: float,
                 turns_per_session: int, chats_per_client: int = 0, pythonpath: Path = REPO) -> None:
        self.bounded = chats_per_client > 0
        tag = f"chatload-{time.monotonic_ns()}"
        self.out = tmp / f"{tag}.out.json"
        config = tmp / f"{tag}.json"
        config.write_text(json.dumps({"url": url, "shards": shards, "plan": plan, "think_s": think_s,
                                      "turns_per_session": turns_per_session,
                                      "chats_per_client": chats_per_client, "out": str(self.out)}))
        env = dict(os.environ, PYTHONPATH=str(pythonpath))
        with open(tmp / f"{tag}.log", "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(SCRIPT), "_chatload", str(config)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env)
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            self.proc.kill()
            raise RuntimeError(f"the chat load did not start: {line!r}, see {tmp / (tag + '.log')}")

    def finish(self, timeout: float = 600) -> dict:
        """Stop (an unbounded load) or wait for it to end; returns its chats and errors."""
        if self.bounded:
            self.proc.stdout.read()  # until it exits by itself
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.proc.stdout.read()
        self.proc.wait(timeout)
        return json.loads(self.out.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def latency_summary(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ms = [v * 1e3 for v in values]
    return {"n": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": max(ms)}


# -- 1 + 2: the big session's GET, alone and under chats --------------------------------------------

def bench_get_and_load(args: argparse.Namespace, tmp: Path, do_get: bool, do_load: bool) -> dict:
    data = tmp / "big-data"
    layers, topk = args.r3_layers, args.r3_topk
    turn_bytes = int(args.turn_mib * MiB)
    turns = max(1, round(args.size_gib * GiB / turn_bytes))
    first = opening_bytes(turn_bytes, layers, topk)
    name = "big-server"
    server = start_server(tmp, name, args.workers, [JOURNAL_FLAG, str(data), "--reference-r3-layers", str(layers),
                                                      "--reference-r3-topk", str(topk), *args.server_arg],
                          args.server_tree)
    sampler = RssSampler(server.pid)
    sampler.start()
    out: dict = {"server_args": args.server_arg, "workers": args.workers, "r3_layers": layers, "r3_topk": topk, "turns": turns,
                 "opening_bytes": first, "load_before": loadavg()}
    buf = bytearray(READ_BUF)
    try:
        http = Http(server.url)
        shards = max(1, args.workers)  # --workers 0: one in-process shard
        big_shard = 1 % shards
        sid = new_session(http, big_shard, shards)
        http.close()
        sampler.set_phase("build")
        print(f"  building {sid}: {turns} turns x ~{args.turn_mib:g} MiB (R3 {layers} layers x top-{topk}, "
              f"opening message {first} bytes) ...", flush=True)
        build = build_session(server.url, sid, turns, first)
        if build.failures:
            raise RuntimeError(f"building the big session failed: {build.failures[:3]}\n{log_tail(tmp, name)}")
        journal = data / JOURNAL_PATH.format(sid=sid)
        journal_size = journal.stat().st_size
        out.update(session_id=sid, shard=big_shard, journal_bytes=journal_size,
                   build_seconds=build.seconds, build_turn_p50_ms=percentile(build.latencies, 50) * 1e3,
                   build_turn_p99_ms=percentile(build.latencies, 99) * 1e3,
                   build_worker_rss_max=sampler.worker_max("build"))
        print(f"  journal {journal_size / GiB:.2f} GiB ({journal_size / turns / MiB:.1f} MiB per turn) in "
              f"{build.seconds:.0f} s; turn p50 {out['build_turn_p50_ms']:.0f} ms", flush=True)
        # the first GET of the fresh session (miles' shape: one GET after the build), then
        # the floor of the same byte count; both warm the page cache and connections
        sampler.set_phase("warm")
        warm = read_get(url_addr(server.url), f"/sessions/{sid}", buf)
        if not warm.complete:
            raise RuntimeError(f"records GET incomplete: status {warm.status}, {warm.got} of {warm.length} "
                               f"bytes\n{log_tail(tmp, name)}")
        floor = SendfileFloor(journal, warm.length)
        try:
            out["records_bytes"] = warm.length
            out["first_get_mib_s"] = warm.mib_s
            out["body_head"], out["body_tail"] = warm.head[:40].decode("latin-1"), warm.tail[-40:].decode("latin-1")
            floor.get(buf)
            gets, floors = [], []
            sampler.set_phase("get")
            server_pids = procfs.tree_pids(server.pid)
            cost: list[tuple[float, int]] = []  # the server's CPU seconds and minor page faults per GET
            for _ in range(args.reps):
                floors.append(floor.get(buf))
                cpu0, faults0 = server_cost(server_pids)
                gets.append(read_get(url_addr(server.url), f"/sessions/{sid}", buf))
                cpu1, faults1 = server_cost(server_pids)
                cost.append((cpu1 - cpu0, faults1 - faults0))
            bad = [g for g in gets if not g.complete]
            if bad:
                out["incomplete_gets"] = [(g.status, g.got, g.length) for g in bad]
            get_rates = [g.mib_s for g in gets]
            floor_rates = [f.mib_s for f in floors]
            out.update(get_mib_s=get_rates, floor_mib_s=floor_rates,
                       get_mib_s_median=statistics.median(get_rates),
                       floor_mib_s_median=statistics.median(floor_rates),
                       get_ratio=statistics.median(get_rates) / statistics.median(floor_rates),
                       get_server_cpu_s=[c for c, _ in cost], get_server_minor_faults=[f for _, f in cost],
                       get_worker_rss_max=sampler.worker_max("get"), get_router_rss_max=sampler.router_max("get"),
                       load_get=loadavg())
            if do_get:
                print(f"  GET {out['records_bytes'] / GiB:.2f} GiB: {out['get_mib_s_median']:.0f} MiB/s (runs "
                      f"{', '.join(f'{r:.0f}' for r in get_rates)}) vs sendfile floor "
                      f"{out['floor_mib_s_median']:.0f} MiB/s ({', '.join(f'{r:.0f}' for r in floor_rates)}): "
                      f"x{out['get_ratio']:.2f}; the first GET {out['first_get_mib_s']:.0f} MiB/s; worker RSS max {out['get_worker_rss_max'] / MiB:.0f} MiB, "
                      f"router {out['get_router_rss_max'] / MiB:.0f} MiB", flush=True)
                print(f"  server CPU per GET {', '.join(f'{c:.2f}' for c, _ in cost)} s, minor page faults per GET "
                      f"{', '.join(str(f) for _, f in cost)}", flush=True)
            if do_load:
                out["load"] = under_load(args, tmp, server, sid, big_shard, floor, buf, sampler)
        finally:
            floor.close()
        out["restarts"] = sampler.restarts
        return out
    finally:
        sampler.stop()
        server.close()
        shutil.rmtree(data, ignore_errors=True)


def under_load(args: argparse.Namespace, tmp: Path, server, sid: str, big_shard: int, floor: SendfileFloor,
               buf: bytearray, sampler: RssSampler) -> dict:
    """Chats run throughout; idle windows (no GET) alternate with GET windows (GETs back to
    back); each chat is classified by the window it started and ended in."""
    shards = max(1, args.workers)  # --workers 0: one in-process shard
    clients = args.chat_clients
    others = [shard for shard in range(shards) if shard != big_shard] or [big_shard]
    plan: list[int | None] = [big_shard if i % 2 == 0 else others[(i // 2) % len(others)] for i in range(clients)]
    load = ChatLoad(tmp, server.url, plan, shards, args.think_ms / 1e3, args.turns_per_session)
    idle_windows: list[tuple[float, float]] = []
    gets: list[GetResult] = []
    floors: list[GetResult] = []
    get_cycles: list[int] = []
    meter = CpuMeter(server.pid, {"chatload": load.proc.pid})
    try:
        time.sleep(args.warmup_s)
        for cycle in range(args.cycles):
            sampler.set_phase("load-idle")
            t0 = time.monotonic()
            with meter.window("idle"):
                time.sleep(args.window_s)
            idle_windows.append((t0, time.monotonic()))
            sampler.set_phase("load-get")
            t0 = time.monotonic()
            with meter.window("get"):
                while True:
                    gets.append(read_get(url_addr(server.url), f"/sessions/{sid}", buf))
                    get_cycles.append(cycle)
                    if time.monotonic() - t0 >= args.window_s:
                        break
            sampler.set_phase("load-floor")
            t0 = time.monotonic()
            with meter.window("floor"):
                while True:  # the control: the same bytes moved by sendfile, not by the server
                    floors.append(floor.get(buf))
                    if time.monotonic() - t0 >= args.window_s:
                        break
        result = load.finish()
    finally:
        load.kill()
    chats = result["chats"]

    def during(windows: list[tuple[float, float]], same: bool | None) -> list[float]:
        picked = []
        for start, end, client, status in chats:
            if status != 200 or (same is not None and (plan[client] == big_shard) != same):
                continue
            if any(ws <= start and end <= we for ws, we in windows):
                picked.append(end - start)
        return picked

    get_windows = [(g.start, g.end) for g in gets]
    floor_windows = [(f.start, f.end) for f in floors]
    out: dict = {"clients": clients, "same_shard_clients": plan.count(big_shard), "think_ms": args.think_ms,
                 "turns_per_session": args.turns_per_session, "gets": len(gets),
                 "incomplete_gets": sum(not g.complete for g in gets),
                 "chat_errors": len(result["errors"]) + sum(1 for c in chats if c[3] != 200),
                 "chat_error_samples": result["errors"][:5],
                 "get_mib_s": [g.mib_s for g in gets], "get_cycle": get_cycles,
                 "floor_loaded_mib_s": [f.mib_s for f in floors], "cores_busy": meter.cores(),
                 "worker_rss_max": sampler.worker_max("load-idle", "load-get", "load-floor"),
                 "router_rss_max": sampler.router_max("load-idle", "load-get", "load-floor"), "load": loadavg()}
    out["get_mib_s_median"] = statistics.median(out["get_mib_s"])
    out["floor_loaded_mib_s_median"] = statistics.median(out["floor_loaded_mib_s"])
    idle_s = sum(e - s for s, e in idle_windows)
    get_s = sum(e - s for s, e in get_windows)
    floor_s = sum(e - s for s, e in floor_windows)
    for label, same in (("all", None), ("same", True), ("other", False)):
        idle, loaded, control = during(idle_windows, same), during(get_windows, same), during(floor_windows, same)
        out[label] = {"idle": latency_summary(idle), "get": latency_summary(loaded),
                      "floor": latency_summary(control),
                      "idle_chats_per_s": len(idle) / idle_s if idle_s else 0.0,
                      "get_chats_per_s": len(loaded) / get_s if get_s else 0.0,
                      "floor_chats_per_s": len(control) / floor_s if floor_s else 0.0}
        if idle and loaded:
            out[label]["p99_ratio"] = out[label]["get"]["p99_ms"] / out[label]["idle"]["p99_ms"]
            out[label]["p50_ratio"] = out[label]["get"]["p50_ms"] / out[label]["idle"]["p50_ms"]
        if idle and control:
            out[label]["floor_p99_ratio"] = out[label]["floor"]["p99_ms"] / out[label]["idle"]["p99_ms"]
    return out


# -- 3: the production shape ------------------------------------------------------------------

def bench_prod(args: argparse.Namespace, tmp: Path) -> dict:
    data = tmp / "prod-data"
    layers, topk = args.r3_layers, args.r3_topk
    turn_bytes = int(args.prod_turn_mib * MiB)
    first = opening_bytes(turn_bytes, layers, topk)
    planned = args.prod_sessions * args.prod_turns * turn_bytes
    free = shutil.disk_usage(tmp).free
    if free < planned * 1.15 + 4 * GiB:
        raise RuntimeError(f"the production shape needs ~{planned / GiB:.1f} GiB (+15% +4 GiB) under {tmp}; "
                           f"{free / GiB:.1f} GiB free: scale it down (--prod-sessions/--prod-turns/--prod-turn-mib)")
    name = "prod-server"
    server = start_server(tmp, name, args.workers, [JOURNAL_FLAG, str(data), "--reference-r3-layers", str(layers),
                                                      "--reference-r3-topk", str(topk)], args.server_tree)
    sampler = RssSampler(server.pid)
    sampler.start()
    out: dict = {"sessions": args.prod_sessions, "turns": args.prod_turns, "turn_mib": args.prod_turn_mib,
                 "opening_bytes": first, "r3_layers": layers, "r3_topk": topk, "load_before": loadavg()}
    try:
        time.sleep(1.0)
        out["worker_rss_idle"] = sampler.worker_max("start")
        http = Http(server.url)
        shards = max(1, args.workers)
        sids = [new_session(http, i % shards, shards) for i in range(args.prod_sessions)]
        http.close()
        sampler.set_phase("turns")
        builds: list[Build] = []
        stop = threading.Event()
        lock = threading.Lock()
        todo = list(sids)
        print(f"  {len(sids)} sessions x {args.prod_turns} turns x ~{args.prod_turn_mib:g} MiB, "
              f"{min(args.prod_concurrency, len(sids))} at once ...", flush=True)

        def runner() -> None:
            while not stop.is_set():
                with lock:
                    if not todo:
                        return
                    sid = todo.pop(0)
                build = build_session(server.url, sid, args.prod_turns, first, stop)
                with lock:
                    builds.append(build)
                if build.failures:
                    stop.set()

        t0 = time.monotonic()
        threads = [threading.Thread(target=runner, daemon=True) for _ in range(min(args.prod_concurrency, len(sids)))]
        for t in threads:
            t.start()
        progress_at = time.monotonic()
        while any(t.is_alive() for t in threads):
            time.sleep(1.0)
            if time.monotonic() - progress_at >= 60:
                progress_at = time.monotonic()
                used = disk_used(data)[1]
                print(f"    {time.monotonic() - t0:.0f} s: {used / GiB:.1f} GiB journaled, worker RSS max so far "
                      f"{sampler.worker_max() / MiB:.0f} MiB, load {loadavg()}", flush=True)
        turns_seconds = time.monotonic() - t0
        latencies = [x for b in builds for x in b.latencies]
        failures = [f for b in builds for f in b.failures]
        allocated, size, files = disk_used(data)
        out.update(turns_seconds=turns_seconds, turns_done=sum(b.turns for b in builds),
                   turns_planned=args.prod_sessions * args.prod_turns, failures=failures[:5],
                   turn_p50_ms=percentile(latencies, 50) * 1e3 if latencies else None,
                   turn_p99_ms=percentile(latencies, 99) * 1e3 if latencies else None,
                   disk_allocated=allocated, disk_file_bytes=size, files=files,
                   worker_rss_max_turns=sampler.worker_max("turns"), router_rss_max_turns=sampler.router_max("turns"),
                   load_turns=loadavg())
        if failures:
            out["server_log_tail"] = log_tail(tmp, name)
        print(f"  {out['turns_done']} / {out['turns_planned']} turns in {turns_seconds:.0f} s "
              f"(p50 {out['turn_p50_ms'] or 0:.0f} ms, p99 {out['turn_p99_ms'] or 0:.0f} ms); disk "
              f"{allocated / GiB:.2f} GiB for {files} files; worker RSS max {out['worker_rss_max_turns'] / MiB:.0f} MiB",
              flush=True)
        sampler.set_phase("gets")
        gets: list[tuple[str, GetResult]] = []
        gets_lock = threading.Lock()
        get_todo = list(sids)

        def getter() -> None:
            buf = bytearray(READ_BUF)
            while True:
                with gets_lock:
                    if not get_todo:
                        return
                    sid = get_todo.pop(0)
                result = read_get(url_addr(server.url), f"/sessions/{sid}", buf)
                with gets_lock:
                    gets.append((sid, result))

        t0 = time.monotonic()
        threads = [threading.Thread(target=getter, daemon=True) for _ in range(args.get_concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gets_seconds = time.monotonic() - t0
        got = sum(r.got for _, r in gets)
        out.update(gets=len(gets), gets_complete=sum(r.complete for _, r in gets),
                   incomplete=[(sid, r.status, r.got, r.length) for sid, r in gets if not r.complete][:5],
                   gets_bytes=got, gets_seconds=gets_seconds, gets_mib_s=got / gets_seconds / MiB,
                   worker_rss_max_gets=sampler.worker_max("gets"), router_rss_max_gets=sampler.router_max("gets"),
                   worker_rss_max=sampler.worker_max(), restarts=sampler.restarts, rss_samples=sampler.samples,
                   load_after=loadavg())
        print(f"  {out['gets_complete']} / {len(gets)} GETs complete, {got / GiB:.2f} GiB in {gets_seconds:.0f} s "
              f"({out['gets_mib_s']:.0f} MiB/s, {args.get_concurrency} at once); worker RSS max "
              f"{out['worker_rss_max_gets'] / MiB:.0f} MiB during GETs", flush=True)
        return out
    finally:
        sampler.stop()
        server.close()
        shutil.rmtree(data, ignore_errors=True)


# -- 4: per-turn commit overhead -------------------------------------------------------------

def extract_tree(commit: str, dest: Path) -> Path:
    """``git archive`` of ``commit``'s webapp/ and shinken_sync/ into ``dest`` (read-only on the repo)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit, "webapp", "shinken_sync"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def bench_commit(args: argparse.Namespace, tmp: Path) -> dict:
    """Three servers up at once; for each client count, the same closed-loop load (no think
    time, sessions of ``--turns-per-session`` turns) on each server in turn, rotated per round."""
    small = ["--reference-r3-layers", "0"]
    variants: dict[str, tuple[list[str], Path]] = {}
    concurrencies = [int(c) for c in str(args.commit_clients).split(",")]
    out: dict = {"clients": concurrencies, "chats_per_round": args.commit_chats, "rounds": args.commit_rounds,
                 "turns_per_session": args.turns_per_session, "fs": fs_type(tmp), "load_before": loadavg()}
    if args.baseline_commit:
        try:
            tree = extract_tree(args.baseline_commit, tmp / "baseline-tree")
            variants["in-memory (before the journal)"] = (small, tree)
            out["baseline_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short",
                                                     args.baseline_commit], capture_output=True, text=True,
                                                    check=True).stdout.strip()
        except (subprocess.CalledProcessError, OSError) as exc:
            out["baseline_error"] = f"could not extract {args.baseline_commit}: {exc}"
    variants["journal, fsync off"] = ([*small, JOURNAL_FLAG, str(tmp / "commit-off")], REPO)
    variants["journal, fsync on"] = ([*small, JOURNAL_FLAG, str(tmp / "commit-on"), FSYNC_FLAG], REPO)
    servers: dict[str, object] = {}
    try:
        for i, (label, (extra, tree)) in enumerate(variants.items()):
            servers[label] = start_server(tmp, f"commit-server-{i}", args.workers, extra, tree)
        labels = list(servers)
        out["shapes"] = {}
        for clients in concurrencies:
            plan: list[int | None] = [None] * clients
            per_client = max(1, args.commit_chats // clients)
            latencies: dict[str, list[float]] = {k: [] for k in labels}
            seconds: dict[str, float] = dict.fromkeys(labels, 0.0)
            errors: dict[str, int] = dict.fromkeys(labels, 0)
            for server in servers.values():  # warm-up, not counted
                ChatLoad(tmp, server.url, plan, args.workers, 0.0, args.turns_per_session,
                         max(5, per_client // 5)).finish()
            for r in range(args.commit_rounds):
                for label in labels[r % len(labels):] + labels[: r % len(labels)]:
                    result = ChatLoad(tmp, servers[label].url, plan, args.workers, 0.0, args.turns_per_session,
                                      per_client).finish()
                    chats = result["chats"]
                    latencies[label] += [end - start for start, end, _, status in chats if status == 200]
                    seconds[label] += max(c[1] for c in chats) - min(c[0] for c in chats)
                    errors[label] += len(result["errors"]) + sum(1 for c in chats if c[3] != 200)
            out["shapes"][str(clients)] = {
                label: {**latency_summary(latencies[label]),
                        "turns_per_s": len(latencies[label]) / seconds[label] if seconds[label] else 0.0,
                        "errors": errors[label]} for label in labels}
        out["load_after"] = loadavg()
    finally:
        for server in servers.values():
            server.close()
    for i, label in enumerate(variants):
        if label.startswith("in-memory") and (tmp / f"state-commit-server-{i}").exists():
            raise RuntimeError("the baseline server made a data directory: it ran the journal code, not "
                               f"{args.baseline_commit}")
    return out


# -- reporting ---------------------------------------------------------------------------------

def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def summary_rows(report: dict) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    g = report.get("get")
    if g and "get_ratio" in g:
        rows.append((f"1. records GET {g['records_bytes'] / GiB:.2f} GiB, workers={g['workers']}",
                     (f"{g['get_mib_s_median']:.0f} MiB/s vs sendfile {g['floor_mib_s_median']:.0f} MiB/s: "
                     f"x{g['get_ratio']:.2f}"), ">= 0.8x", verdict(g["get_ratio"] >= 0.8)))
        rows.append(("   worker / router RSS max during the GETs",
                     f"{g['get_worker_rss_max'] / MiB:.0f} / {g['get_router_rss_max'] / MiB:.0f} MiB", "", ""))
    lo = g.get("load") if g else None
    if lo:
        floor = g["floor_mib_s_median"]
        ratio = lo["get_mib_s_median"] / floor
        rows.append((f"2. GET under {lo['clients']} chatting clients",
                     (f"{lo['get_mib_s_median']:.0f} MiB/s vs floor {floor:.0f} (idle) / "
                     f"{lo['floor_loaded_mib_s_median']:.0f} (same chats): x{ratio:.2f} / "
                     f"x{lo['get_mib_s_median'] / lo['floor_loaded_mib_s_median']:.2f}"),
                     ">= 0.5x", verdict(ratio >= 0.5)))
        for label, what in (("all", "all chats"), ("same", "same shard"), ("other", "other shard")):
            s = lo[label]
            if "p99_ratio" not in s:
                continue
            rows.append((f"   chat {what}: idle -> during GET",
                         (f"p50 {s['idle']['p50_ms']:.1f} -> {s['get']['p50_ms']:.1f} ms, p99 {s['idle']['p99_ms']:.1f} "
                         f"-> {s['get']['p99_ms']:.1f} ms: x{s['p99_ratio']:.2f} (n {s['idle']['n']}/{s['get']['n']}, "
                         f"{s['idle_chats_per_s']:.0f} -> {s['get_chats_per_s']:.0f} chats/s)"),
                         "p99 within 1.5x", verdict(s["p99_ratio"] <= 1.5)))
            if "floor_p99_ratio" in s:
                rows.append(("     control: during a sendfile floor instead of the GET",
                             (f"p50 {s['floor']['p50_ms']:.1f} ms, p99 {s['floor']['p99_ms']:.1f} ms: "
                              f"x{s['floor_p99_ratio']:.2f} of idle ({s['floor_chats_per_s']:.0f} chats/s)"), "", ""))
    p = report.get("prod")
    if p and "worker_rss_max" in p:
        ok = (p["turns_done"] == p["turns_planned"] and p["gets_complete"] == p["gets"] == p["sessions"])
        rows.append((f"3. {p['sessions']} x {p['turns']} turns x {p['turn_mib']:g} MiB: all 200, GETs complete",
                     f"{p['turns_done']}/{p['turns_planned']} turns, {p['gets_complete']}/{p['sessions']} GETs",
                     "all", verdict(ok)))
        rows.append(("   max worker RSS (turns and GETs)", (f"{p['worker_rss_max'] / MiB:.0f} MiB "
                     f"(turns {p['worker_rss_max_turns'] / MiB:.0f}, GETs {p['worker_rss_max_gets'] / MiB:.0f}; "
                     f"router {max(p['router_rss_max_turns'], p['router_rss_max_gets']) / MiB:.0f})"),
                     "< 1 GiB", verdict(p["worker_rss_max"] < GiB)))
        rows.append(("   disk used", (f"{p['disk_allocated'] / GiB:.2f} GiB allocated, {p['disk_file_bytes'] / GiB:.2f}"
                     f" GiB in {p['files']} files; GETs {p['gets_bytes'] / GiB:.2f} GiB at "
                     f"{p['gets_mib_s']:.0f} MiB/s"), "", ""))
    c = report.get("commit")
    if c and "shapes" in c:
        for clients, variants in c["shapes"].items():
            base = next((v for k, v in variants.items() if k.startswith("in-memory")), None)
            for label, v in variants.items():
                if not v.get("n"):
                    continue
                extra = ""
                if base and base is not v and base.get("n"):
                    extra = f" ({v['p50_ms'] - base['p50_ms']:+.2f} / {v['p99_ms'] - base['p99_ms']:+.2f} ms)"
                rows.append((f"4. small-record chat, {clients} client(s): {label}",
                             (f"p50 {v['p50_ms']:.2f} ms, p99 {v['p99_ms']:.2f} ms{extra}, {v['turns_per_s']:.0f} "
                              f"turns/s, {v['errors']} errors"), "", ""))
    if c and "baseline_error" in c:
        rows.append(("4. in-memory baseline", c["baseline_error"], "", ""))
    return rows


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(4)] if rows else [0] * 4
    for r in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip())


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_chatload":
        chatload_main(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="get,load,prod,commit", help="comma list of: get,load,prod,commit")
    parser.add_argument("--quick", action="store_true", help="a scaled-down smoke run (minutes, noisier)")
    parser.add_argument("--json", default=None, help="also write the figures as JSON here")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--server-tree", type=Path, default=REPO,
                        help="1-3: the source tree the server runs from (another commit's checkout: the same bench "
                             "and floor against its code)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="1+2: one more launcher argument for the big session's server, e.g. "
                             "--server-arg=--records-get-pace=512 (repeatable; the tree must know it)")
    parser.add_argument("--r3-layers", type=int, default=6, help="the reference backend's R3 layers")
    parser.add_argument("--r3-topk", type=int, default=8, help="the reference backend's R3 top-k")
    parser.add_argument("--size-gib", type=float, default=4.0, help="1+2: the big session's records")
    parser.add_argument("--turn-mib", type=float, default=64.0, help="1+2: R3 per turn of the big session")
    parser.add_argument("--reps", type=int, default=3, help="1: GETs and floors, alternated")
    parser.add_argument("--chat-clients", type=int, default=64, help="2: chatting clients")
    parser.add_argument("--think-ms", type=float, default=250.0,
                        help="2: each client's pause between chats (a computer-use step's action + screenshot)")
    parser.add_argument("--turns-per-session", type=int, default=4, help="2+4: a chat client's session length")
    parser.add_argument("--window-s", type=float, default=15.0, help="2: each idle and each GET window")
    parser.add_argument("--cycles", type=int, default=3, help="2: idle/GET window pairs")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="2: chats before the first window")
    parser.add_argument("--prod-sessions", type=int, default=8)
    parser.add_argument("--prod-turns", type=int, default=50)
    parser.add_argument("--prod-turn-mib", type=float, default=64.0)
    parser.add_argument("--prod-concurrency", type=int, default=8, help="3: sessions driven at once")
    parser.add_argument("--get-concurrency", type=int, default=2, help="3: final GETs at once")
    parser.add_argument("--commit-clients", default="1,16", help="4: concurrent clients, a comma list (1: latency)")
    parser.add_argument("--commit-chats", type=int, default=600, help="4: chats per round and server")
    parser.add_argument("--commit-rounds", type=int, default=3)
    parser.add_argument("--baseline-commit", default="a483994",
                        help="4: the last commit before the journal ('' to skip the in-memory baseline)")
    args = parser.parse_args()
    if args.quick:
        for name, value in (("size_gib", 0.5), ("turn_mib", 16.0), ("reps", 2), ("chat_clients", 16),
                            ("window_s", 5.0), ("cycles", 1), ("prod_sessions", 2), ("prod_turns", 8),
                            ("prod_turn_mib", 16.0), ("commit_chats", 120), ("commit_rounds", 1)):
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    only = set(args.only.split(","))
    json_path = Path(args.json).resolve() if args.json else None
    cwd = os.getcwd()
    tmp = Path(tempfile.mkdtemp(prefix="records-journal-bench-"))
    os.chdir(tmp)  # servers start here: `python -m webapp.serve` puts the cwd first on sys.path

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks: servers stopped, tmp deleted

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    report: dict = {"argv": sys.argv[1:], "tmp_fs": fs_type(tmp), "load_start": loadavg(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print(f"records journal bench; temp dir {tmp} on {report['tmp_fs']}; load {report['load_start']}", flush=True)
    try:
        if only & {"get", "load"}:
            print("1/2. the big session's records GET" + (", then under chats" if "load" in only else ""), flush=True)
            report["get"] = bench_get_and_load(args, tmp, "get" in only, "load" in only)
            if "load" in only:
                lo = report["get"]["load"]
                print(f"  under load: GET {lo['get_mib_s_median']:.0f} MiB/s ({lo['gets']} GETs, "
                      f"{lo['incomplete_gets']} incomplete), floor under the same chats "
                      f"{lo['floor_loaded_mib_s_median']:.0f} MiB/s; chat errors {lo['chat_errors']}", flush=True)
                print("  each GET (cycle: MiB/s): " + ", ".join(
                    f"{c}: {r:.0f}" for c, r in zip(lo["get_cycle"], lo["get_mib_s"])), flush=True)
                for label, cores in lo["cores_busy"].items():
                    print(f"  cores busy in the {label} windows: "
                          + ", ".join(f"{role} {v:.2f}" for role, v in cores.items()), flush=True)
        if "prod" in only:
            print("3. production shape", flush=True)
            report["prod"] = bench_prod(args, tmp)
        if "commit" in only:
            print("4. per-turn commit overhead (small records)", flush=True)
            report["commit"] = bench_commit(args, tmp)
    finally:
        report["load_end"] = loadavg()
        os.chdir(cwd)
        shutil.rmtree(tmp, ignore_errors=True)
        if json_path is not None:
            json_path.write_text(json.dumps(report, indent=2, default=str))
    print()
    print(f"summary (load at start {report['load_start']}, at end {report['load_end']}):")
    print_table(summary_rows(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
