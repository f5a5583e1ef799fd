"""Side by side with miles' own session server: the same load, one run, same-run ratios.

    PYTHONPATH=$PWD python bench/miles_side_by_side.py [--miles-repo GIT_DIR_OR_URL] [--clients 64]
        [--chats 100] [--turns 10] [--records-mib 250] [--ours-old 37e6388] [--only NAMES] [--json OUT]

Servers, each started once and measured in turn with the same load, against one engine: our
reference backend (``webapp.reference_backend``, SGLang's dialect, R3 on: ``--r3-layers`` x
``--r3-topk`` routed experts per token) on loopback, with one small byte-level BPE tokenizer
trained here that every server and the engine load:

- ``ours-w0`` / ``ours-w2``: this tree's ``shinken-session-server --workers 0`` / ``--workers 2``
  (journal on, in a temporary state directory);
- ``old-w0``: our tree at ``--ours-old`` (default 37e6388), extracted with ``git archive`` into
  the scratch directory, ``--workers 0`` (empty: skipped);
- ``base-w0``: our tree at ``--ours-base`` (a second commit, e.g. the one a change started from,
  measured in the same run: its CPU per chat against ``ours-w0``'s), as ``old-w0``;
- ``miles-main``: miles' single-process session server (``miles.rollout.session.server``, its
  own ``run_session_server`` entry point) at ``--miles-ref`` (default: the repository's HEAD);
- ``miles-pr-w2``: miles' multi-process data plane (router + 2 workers over UNIX-socket IPC) at
  ``--miles-pr-ref`` (default 659257b13, the data-plane change as merged into miles' main and
  later reverted: it is in the history of main, so a mirror of main has it). That change left
  the process launch to a later change, so ``bench/miles_launch.py`` launches it from its own
  pieces. ``--miles-tree DIR`` / ``--miles-pr-tree DIR`` use a checkout as it is instead.

miles runs in a scratch venv (``--scratch``, default ``$XDG_CACHE_HOME/shinken-bench/miles``;
reused when present, never in the repository) with FastAPI, uvicorn, httpx, transformers and
the rest of what its session path calls; for the packages it imports but never calls on that
path (torch, ray, sglang, ...) ``bench/miles_launch.py`` installs stand-ins that raise if
called. miles' session server speaks SGLang's OpenAI endpoint: it proxies ``POST
/v1/chat/completions`` with ``input_ids``, ``logprobs``, ``return_meta_info`` and, with
``use_rollout_routing_replay``, ``return_routed_experts`` to the engine URL (``do_proxy``),
which is what the reference backend serves.

The load: ``--clients`` client threads (in ``--load-procs`` load processes) each run ``--chats``
chats as conversations of ``--turns`` turns: a new session, then each turn sends the whole
conversation so far (the replies it got, then one more user message) to
``/sessions/{id}/v1/chat/completions``; the session is deleted after its last turn. Reported:
chats/s over the load's wall time (``--rounds``: the order of the servers rotated each round,
each server's rounds pooled), p50/p99 of a chat's latency, the server's CPU per chat (utime
+ stime of the server's process tree from /proc, before and after the load), then one records
GET: a fresh session grown to ~``--records-mib`` MiB of records (``--records-turns`` turns, long
user messages so the R3 per turn is large), then one timed ``GET /sessions/{id}`` read and
discarded. Ratios against the targets are printed after the table.

Everything shares the machine's cores (load generators, engine, servers): read the ratios,
measured side by side in one run, before absolute numbers. Only loopback sockets are used.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import procfs
from rawhttp import Http, MiB
from scratch import scratch_state_home

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = Path(__file__).resolve().parent / "miles_launch.py"
MILES_GITHUB = "https://github.com/radixark/miles.git"
MILES_PR_COMMIT = "659257b13"  # the multi-process data plane (merged into main, later reverted)
OURS_OLD = "37e6388"
# What miles' session path imports and calls for real; transformers at the version miles pins.
MILES_VENV_PACKAGES = ("transformers==5.12.1", "fastapi", "uvicorn", "httpx", "pybase64", "setproctitle",
                       "safetensors>=0.8.0", "numpy", "pydantic", "jinja2")
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ALL_SERVERS = ("ours-w0", "ours-w2", "old-w0", "base-w0", "miles-main", "miles-pr-w2")
DEFAULT_SERVERS = ("ours-w0", "ours-w2", "old-w0", "miles-main", "miles-pr-w2")
TARGETS = "ours-w0 >= 3x miles-main chats/s, p99 <= 0.15x; ours-w2 >= 2x miles-pr-w2 chats/s, p50 <= 1x; " \
          "CPU/chat ours-w0 <= 0.9x old-w0"


def default_scratch() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shinken-bench" / "miles"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/miles_side_by_side.py", description=__doc__.split("\n")[0],
                                 epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--miles-repo", default=MILES_GITHUB,
                    help="miles' git repository: a local (bare) git directory, or a URL cloned bare into the "
                         "scratch directory (default: %(default)s)")
    ap.add_argument("--miles-ref", default="HEAD", help="miles commit for miles-main (default: HEAD)")
    ap.add_argument("--miles-pr-ref", default=MILES_PR_COMMIT,
                    help="miles commit with the multi-process data plane for miles-pr-w2 (default: %(default)s)")
    ap.add_argument("--miles-tree", help="use this miles checkout for miles-main instead of --miles-repo")
    ap.add_argument("--miles-pr-tree", help="use this miles checkout (with router.py/worker.py) for miles-pr-w2")
    ap.add_argument("--ours-old", default=OURS_OLD, help="our commit for old-w0 ('' to skip; default %(default)s)")
    ap.add_argument("--scratch", type=Path, default=default_scratch(),
                    help="scratch directory for the venv and the extracted trees (reused; default %(default)s)")
    ap.add_argument("--ours-base", default="",
                    help="our commit for base-w0, a second old tree in the same run (with --only ...,base-w0)")
    ap.add_argument("--only", default=",".join(DEFAULT_SERVERS),
                    help=f"servers to run, of {','.join(ALL_SERVERS)} (default: {','.join(DEFAULT_SERVERS)})")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients (default %(default)s)")
    ap.add_argument("--chats", type=int, default=100, help="chats per client (default %(default)s)")
    ap.add_argument("--turns", type=int, default=10, help="turns per conversation (session) (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="load rounds per server, the order rotated each round (default %(default)s)")
    ap.add_argument("--load-procs", type=int, default=2, help="processes the client threads are spread over")
    ap.add_argument("--r3-layers", type=int, default=4, help="engine routed-expert layers (default %(default)s)")
    ap.add_argument("--r3-topk", type=int, default=8, help="engine routed experts per layer (default %(default)s)")
    ap.add_argument("--records-mib", type=float, default=250.0,
                    help="records size of the GET session, MiB (0: no records GET; default %(default)s)")
    ap.add_argument("--records-turns", type=int, default=10, help="turns of the records GET session")
    ap.add_argument("--json", help="also write the results here as JSON")
    ap.add_argument("--load-worker", help=argparse.SUPPRESS)  # internal: run one load process
    args = ap.parse_args(argv)
    unknown = set(args.only.split(",")) - set(ALL_SERVERS)
    if unknown:
        ap.error(f"--only: unknown servers {sorted(unknown)}")
    if "base-w0" in args.only.split(",") and not args.ours_base:
        ap.error("--only base-w0 needs --ours-base COMMIT")
    if min(args.clients, args.chats, args.turns, args.load_procs, args.rounds) < 1:
        ap.error("--clients, --chats, --turns, --load-procs and --rounds must be >= 1")
    return args


# ---- scratch: trees, venv, tokenizer --------------------------------------------------------------

def run(cmd: list[str], **kw: object) -> None:
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]  # kw passes through to run


def miles_git_dir(args: argparse.Namespace) -> Path:
    """A local git directory holding miles' history: ``--miles-repo`` if local, else a bare clone."""
    local = Path(args.miles_repo)
    if local.exists():
        return local
    clone = args.scratch / "miles.git"
    if not clone.exists():
        run(["git", "clone", "--bare", "--quiet", args.miles_repo, str(clone)])
    return clone


def extract(git_dir: Path, commit: str, dest: Path) -> Path:
    """``git archive`` of ``commit`` into ``dest`` (reused when already there)."""
    if (dest / ".extracted").exists():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", commit], check=True, capture_output=True)
    run(["tar", "-x", "-C", str(dest)], input=archive.stdout)
    (dest / ".extracted").write_text(commit)
    return dest


def resolve(git_dir: Path, ref: str) -> str:
    out = subprocess.run(["git", "--git-dir", str(git_dir), "rev-parse", "--short=9", f"{ref}^{{commit}}"],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def miles_venv(scratch: Path) -> Path:
    """The scratch venv's python, built on first use (a marker says the install finished)."""
    venv = scratch / "venv"
    python = venv / "bin" / "python"
    marker = venv / ".bench-packages"
    if marker.exists() and marker.read_text() == "\n".join(MILES_VENV_PACKAGES):
        return python
    run([sys.executable, "-m", "venv", "--clear", str(venv)])
    run([str(python), "-m", "pip", "install", "--quiet", *MILES_VENV_PACKAGES])
    marker.write_text("\n".join(MILES_VENV_PACKAGES))
    return python


def make_tokenizer(dest: Path) -> Path:
    """A small byte-level BPE ``tokenizer.json`` (trained here) with a ChatML template: what our
    server, the engine and transformers' AutoTokenizer (miles) all load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the agent clicks the button on the screen and types hello world"] * 20, trainer)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML}))
    return dest


# ---- servers --------------------------------------------------------------------------------------

@dataclass
class Server:
    name: str
    url: str
    pid: int
    close: object  # () -> None
    label: str


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_health(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url}: not healthy after {timeout:.0f} s: {log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def start_ours(name: str, tree: Path, workers: int, backend: str, tokenizer: Path, logs: Path,
               r3_layers: int) -> Server:
    from webapp.serve import server_argv

    log = logs / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=str(tree))
    argv = server_argv(workers, backend, "127.0.0.1:0", "--tokenizer", str(tokenizer))
    # R3 on: a tree with the routing-replay setting asks the engine for routed experts only when
    # it is set (with an external engine); older trees asked whenever the engine returned them.
    if "routing_replay_layers" in (tree / "webapp" / "settings.py").read_text():
        argv += ["--routing-replay-layers", str(r3_layers)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log.open("wb"), env=env, cwd=tree,
                            start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"{name}: no ready line, exit {proc.returncode}: {log.read_text()[-3000:]}")
    ready = json.loads(line)
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain
    url = str(ready["url"])
    wait_health(url, proc, log)
    return Server(name, url, proc.pid, lambda: stop(proc), f"shinken {tree.name} --workers {workers}")


def start_miles(name: str, python: Path, tree: Path, workers: int, backend: str, tokenizer: Path,
                logs: Path) -> Server:
    log = logs / f"{name}.log"
    port = free_port()
    argv = [str(python), str(LAUNCHER), "--miles-tree", str(tree), "--tokenizer", str(tokenizer), "--backend", backend,
            "--port", str(port), "--workers", str(workers)]
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, proc, log)
    return Server(name, url, proc.pid, lambda: stop(proc), f"miles {tree.name} workers={workers}")


# ---- the load -------------------------------------------------------------------------------------

def user_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 ") for _ in range(n))


def conversation(http: Http, turns: int, rng: random.Random, latencies: list[float], first_chars: int = 40,
                 keep: bool = False) -> str:
    """One session of ``turns`` chats; each turn's latency appended. Returns the session id."""
    status, body = http.request("POST", "/sessions", b"")
    if status != 200:
        raise RuntimeError(f"POST /sessions: {status} {body!r:.300}")
    sid = json.loads(body)["session_id"]  # type: ignore[arg-type]  # body is bytes when not sinking
    messages: list[dict[str, str]] = []
    for turn in range(turns):
        # An agent loop: a user task, then each turn appends a tool's output (miles' default TITO
        # tokenizer allows only tool messages to be appended after an assistant turn).
        messages.append({"role": "user" if turn == 0 else "tool",
                         "content": user_text(rng, first_chars if turn == 0 else 40)})
        payload = json.dumps({"model": "reference", "messages": messages, "max_tokens": 64}).encode()
        t0 = time.perf_counter()
        status, body = http.request("POST", f"/sessions/{sid}/v1/chat/completions", payload)
        latencies.append(time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"chat turn {turn}: {status} {body!r:.300}")
        reply = json.loads(body)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    if not keep:
        http.request("DELETE", f"/sessions/{sid}")
    return sid


def load_worker(config_path: str) -> None:
    """One load process: threads, each its own keep-alive connection; prints JSON results."""
    cfg = json.loads(Path(config_path).read_text())
    results: list[list[float]] = [[] for _ in range(cfg["threads"])]
    errors: list[str] = []
    start = threading.Barrier(cfg["threads"] + 1)

    def client(i: int) -> None:
        rng = random.Random(cfg["seed"] * 1000 + i)
        http = Http(cfg["url"])
        start.wait()
        try:
            done = 0
            while done < cfg["chats"]:
                turns = min(cfg["turns"], cfg["chats"] - done)
                conversation(http, turns, rng, results[i])
                done += turns
        except Exception as exc:  # noqa: BLE001 (reported; the run is then void)
            errors.append(f"client {i}: {exc}")
        finally:
            http.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(cfg["threads"])]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join()
    print(json.dumps({"latencies": [x for r in results for x in r], "errors": errors}))


@dataclass
class Result:
    server: str
    label: str
    chats: int
    seconds: float
    chats_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_chat: float
    records_mib: float | None = None
    get_mib_s: float | None = None


def pct(values: list[float], q: float) -> float:
    from shinken_sync.stats import percentile

    return percentile(values, q)


def measure_chats(server: Server, args: argparse.Namespace, tmp: Path) -> tuple[int, float, list[float], float]:
    """One load on ``server``: (chats, wall seconds, latencies in ms, server CPU seconds)."""
    procs = []
    per = [args.clients // args.load_procs + (1 if i < args.clients % args.load_procs else 0)
           for i in range(args.load_procs)]
    cpu0 = procfs.tree_cpu(server.pid)
    t0 = time.perf_counter()
    for i, threads in enumerate(t for t in per if t):
        cfg = tmp / f"load-{server.name}-{i}.json"
        cfg.write_text(json.dumps({"url": server.url, "threads": threads, "chats": args.chats, "turns": args.turns,
                                   "seed": i}))
        procs.append(subprocess.Popen([sys.executable, __file__, "--load-worker", str(cfg)], stdout=subprocess.PIPE,
                                      env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))))
    latencies: list[float] = []
    for proc in procs:
        out, _ = proc.communicate()
        got = json.loads(out)
        if got["errors"]:
            raise RuntimeError(f"{server.name}: {len(got['errors'])} clients failed: {got['errors'][:3]}")
        latencies += got["latencies"]
    seconds = time.perf_counter() - t0
    cpu = procfs.tree_cpu(server.pid) - cpu0
    return len(latencies), seconds, [x * 1e3 for x in latencies], cpu


def measure_records_get(server: Server, args: argparse.Namespace, tokens_per_char: float) -> tuple[float, float]:
    """Grow one session to ~``--records-mib`` of records, then time one GET of it: (MiB, MiB/s)."""
    r3_bytes_per_token = args.r3_layers * args.r3_topk * 4 * 4 / 3  # int32, base64
    # Every turn's reply carries R3 for its whole prompt, about the opening message's tokens
    # (later turns add 40 characters each), so the records hold about turns x that.
    turns = args.records_turns
    opening_tokens = args.records_mib * MiB / r3_bytes_per_token / turns
    http = Http(server.url)
    try:
        sid = conversation(http, turns, random.Random(7), [], first_chars=int(opening_tokens / tokens_per_char),
                           keep=True)
        t0 = time.perf_counter()
        status, size = http.request("GET", f"/sessions/{sid}", sink=True)
        seconds = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"{server.name}: records GET {status}")
        http.request("DELETE", f"/sessions/{sid}")
    finally:
        http.close()
    assert isinstance(size, int)
    return size / MiB, size / MiB / seconds


# ---- the run --------------------------------------------------------------------------------------

def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def report(results: dict[str, Result]) -> list[tuple[str, float | None, str, str]]:
    r = results.get
    checks: list[tuple[str, float | None, str, str]] = []

    def add(name: str, value: float | None, target: str, ok: bool | None) -> None:
        checks.append((name, value, target, "n/a" if value is None or ok is None else ("met" if ok else "NOT met")))

    def field(name: str, attr: str) -> float | None:
        res = r(name)
        return None if res is None else getattr(res, attr)

    v = ratio(field("ours-w0", "chats_per_s"), field("miles-main", "chats_per_s"))
    add("chats/s ours-w0 / miles-main", v, ">= 3", None if v is None else v >= 3)
    v = ratio(field("ours-w0", "p99_ms"), field("miles-main", "p99_ms"))
    add("p99 ours-w0 / miles-main", v, "<= 0.15", None if v is None else v <= 0.15)
    v = ratio(field("ours-w0", "p50_ms"), field("miles-main", "p50_ms"))
    add("p50 ours-w0 / miles-main", v, "(info)", None)
    v = ratio(field("ours-w2", "chats_per_s"), field("miles-pr-w2", "chats_per_s"))
    add("chats/s ours-w2 / miles-pr-w2", v, ">= 2", None if v is None else v >= 2)
    v = ratio(field("ours-w2", "p50_ms"), field("miles-pr-w2", "p50_ms"))
    add("p50 ours-w2 / miles-pr-w2", v, "<= 1", None if v is None else v <= 1)
    v = ratio(field("ours-w2", "p99_ms"), field("miles-pr-w2", "p99_ms"))
    add("p99 ours-w2 / miles-pr-w2", v, "(info)", None)
    v = ratio(field("ours-w0", "cpu_ms_per_chat"), field("miles-main", "cpu_ms_per_chat"))
    add("CPU/chat ours-w0 / miles-main", v, "(info)", None)
    v = ratio(field("ours-w0", "cpu_ms_per_chat"), field("old-w0", "cpu_ms_per_chat"))
    add("CPU/chat ours-w0 / old-w0", v, "<= 0.9", None if v is None else v <= 0.9)
    v = ratio(field("ours-w0", "cpu_ms_per_chat"), field("base-w0", "cpu_ms_per_chat"))
    add("CPU/chat ours-w0 / base-w0", v, "(info)", None)
    v = ratio(field("base-w0", "cpu_ms_per_chat"), field("old-w0", "cpu_ms_per_chat"))
    add("CPU/chat base-w0 / old-w0", v, "(info)", None)
    v = ratio(field("ours-w0", "get_mib_s"), field("miles-main", "get_mib_s"))
    add("records GET MiB/s ours-w0 / miles-main", v, "(info)", None)
    v = ratio(field("ours-w2", "get_mib_s"), field("miles-pr-w2", "get_mib_s"))
    add("records GET MiB/s ours-w2 / miles-pr-w2", v, "(info)", None)
    return checks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.load_worker:
        load_worker(args.load_worker)
        return 0
    from tabulate import tabulate

    from webapp.reference_backend import start_reference_backend

    wanted = args.only.split(",")
    scratch_state_home()  # our servers' journals (on) go to a temporary state directory
    args.scratch.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="miles-side-by-side-"))
    logs = tmp / "logs"
    logs.mkdir()
    print(f"load before: {procfs.loadavg()}  (scratch {args.scratch}, logs {logs})", flush=True)

    trees: dict[str, Path] = {}
    commits: dict[str, str] = {}
    if "miles-main" in wanted or "miles-pr-w2" in wanted:
        git_dir = None if args.miles_tree and (args.miles_pr_tree or "miles-pr-w2" not in wanted) else miles_git_dir(args)
        if "miles-main" in wanted:
            if args.miles_tree:
                trees["miles-main"], commits["miles-main"] = Path(args.miles_tree), "(given tree)"
            else:
                assert git_dir is not None
                commits["miles-main"] = resolve(git_dir, args.miles_ref)
                trees["miles-main"] = extract(git_dir, commits["miles-main"], args.scratch / f"miles-{commits['miles-main']}")
        if "miles-pr-w2" in wanted:
            if args.miles_pr_tree:
                trees["miles-pr-w2"], commits["miles-pr-w2"] = Path(args.miles_pr_tree), "(given tree)"
            else:
                assert git_dir is not None
                commits["miles-pr-w2"] = resolve(git_dir, args.miles_pr_ref)
                trees["miles-pr-w2"] = extract(git_dir, commits["miles-pr-w2"],
                                               args.scratch / f"miles-{commits['miles-pr-w2']}")
        python = miles_venv(args.scratch)
    for name, ref in (("old-w0", args.ours_old), ("base-w0", args.ours_base)):
        if name in wanted and ref:
            git_common = Path(subprocess.run(["git", "-C", str(REPO), "rev-parse", "--path-format=absolute",
                                              "--git-common-dir"], check=True, capture_output=True,
                                             text=True).stdout.strip())
            commits[name] = resolve(git_common, ref)
            trees[name] = extract(git_common, commits[name], args.scratch / f"ours-{commits[name]}")
    tokenizer = make_tokenizer(tmp / "tokenizer")
    from tokenizers import Tokenizer

    sample = user_text(random.Random(1), 20000)
    tokens_per_char = len(Tokenizer.from_file(str(tokenizer / "tokenizer.json")).encode(sample).ids) / len(sample)

    backend = start_reference_backend(tokenizer=str(tokenizer), r3_layers=args.r3_layers, r3_topk=args.r3_topk)
    servers: list[Server] = []
    results: dict[str, Result] = {}
    try:
        for name in wanted:
            if name == "ours-w0":
                servers.append(start_ours(name, REPO, 0, backend.url, tokenizer, logs, args.r3_layers))
            elif name == "ours-w2":
                servers.append(start_ours(name, REPO, 2, backend.url, tokenizer, logs, args.r3_layers))
            elif name in ("old-w0", "base-w0") and name in trees:
                servers.append(start_ours(name, trees[name], 0, backend.url, tokenizer, logs, args.r3_layers))
            elif name == "miles-main":
                servers.append(start_miles(name, python, trees[name], 0, backend.url, tokenizer, logs))
            elif name == "miles-pr-w2":
                servers.append(start_miles(name, python, trees[name], 2, backend.url, tokenizer, logs))
        for server in servers:
            # Warm-up: one conversation, so first-request costs (imports, pools) stay out of the figures.
            http = Http(server.url)
            conversation(http, args.turns, random.Random(99), [])
            http.close()
        # Rounds rotate the order, so no server always runs first (or last) while the shared
        # machine's load drifts; a server's figures pool its rounds.
        pooled: dict[str, list[tuple[int, float, list[float], float]]] = {s.name: [] for s in servers}
        for round_ in range(args.rounds):
            shift = round_ % len(servers)
            for server in servers[shift:] + servers[:shift]:
                print(f"round {round_ + 1}: {server.name}: {server.label} at {server.url} ...", flush=True)
                pooled[server.name].append(measure_chats(server, args, tmp))
                n, seconds, lat, cpu = pooled[server.name][-1]
                print(f"  {n} chats {n / seconds:.0f}/s p50 {pct(lat, 50):.0f} ms p99 {pct(lat, 99):.0f} ms "
                      f"CPU {cpu / n * 1e3:.2f} ms/chat; load {procfs.loadavg()}", flush=True)
        for server in servers:
            n = sum(r[0] for r in pooled[server.name])
            seconds = sum(r[1] for r in pooled[server.name])
            lat = [x for r in pooled[server.name] for x in r[2]]
            cpu = sum(r[3] for r in pooled[server.name])
            res = Result(server.name, server.label, n, seconds, n / seconds, pct(lat, 50), pct(lat, 99), cpu / n * 1e3)
            if args.records_mib > 0:
                res.records_mib, res.get_mib_s = measure_records_get(server, args, tokens_per_char)
            results[server.name] = res
            print(f"  {asdict(res)}", flush=True)
    finally:
        for server in servers:
            server.close()  # type: ignore[operator]  # a () -> None
        backend.close()
    print(f"\nload after: {procfs.loadavg()}; {args.clients} clients x {args.chats} chats, conversations of "
          f"{args.turns} turns, R3 {args.r3_layers}x{args.r3_topk}; commits {commits}\n")
    rows = [[r.server, r.label, r.chats, f"{r.chats_per_s:.0f}", f"{r.p50_ms:.0f}", f"{r.p99_ms:.0f}",
             f"{r.cpu_ms_per_chat:.2f}", "-" if r.records_mib is None else f"{r.records_mib:.0f}",
             "-" if r.get_mib_s is None else f"{r.get_mib_s:.0f}"] for r in results.values()]
    print(tabulate(rows, headers=["server", "what", "chats", "chats/s", "p50 ms", "p99 ms", "CPU ms/chat",
                                  "records MiB", "GET MiB/s"]))
    checks = report(results)
    print()
    print(tabulate([[n, "-" if v is None else f"{v:.2f}", t, s] for n, v, t, s in checks],
                   headers=["same-run ratio", "value", "target", ""]))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": [asdict(r) for r in results.values()],
                                               "ratios": checks, "commits": commits, "args": {
                                                   k: str(v) for k, v in vars(args).items()}}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
