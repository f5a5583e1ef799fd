"""Worker supervision under real gunicorn: a killed or hung worker fails only its shard (503
at once), is restarted with its sessions gone (404); shutdown and a dead router leave no
worker behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import requests

from webapp.serve import server_argv
from webapp.sharding import shard_for
from webapp.supervisor import Supervisor, SupervisorConfig
from webapp.worker import EXIT_BOOT_ERROR

WORKERS = 3
RECOVERY_LIMIT = 30.0  # generous bound for a restart on a loaded 2-core machine (not a speed target)


def worker_procs(server, shards: int = WORKERS) -> dict[int, psutil.Process]:
    found = {}
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        for shard in range(shards):
            if f"shinken-session-worker[{shard}/{shards}]" in cmdline:
                found[shard] = proc
    return found


def wait_healthy(base: str, limit: float = RECOVERY_LIMIT) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if requests.get(f"{base}/health", timeout=10).status_code == 200:
            return
        time.sleep(0.1)
    raise AssertionError(f"/health not 200 within {limit} s")


def sessions_by_shard(base: str, shards: int = WORKERS) -> dict[int, str]:
    owned: dict[int, str] = {}
    while len(owned) < shards:
        sid = requests.post(f"{base}/sessions", timeout=10).json()["session_id"]
        owned.setdefault(shard_for(sid, shards), sid)
    return owned


def chat(base: str, sid: str) -> requests.Response:
    return requests.post(f"{base}/sessions/{sid}/v1/chat/completions", timeout=30,
                         json={"messages": [{"role": "user", "content": "click the button"}]})


@pytest.fixture(scope="module")
def server(reference_backend_factory, session_server_factory):
    backend = reference_backend_factory()
    return session_server_factory.launch(WORKERS, backend.url, "--heartbeat-timeout", "3")


def test_refuses_zero_workers_and_an_unpatched_process() -> None:
    with pytest.raises(ValueError):
        SupervisorConfig(workers=0, core={})
    supervisor = Supervisor(SupervisorConfig(workers=1, core={"backend_url": "http://127.0.0.1:9"}))
    with pytest.raises(RuntimeError):  # this pytest process is not gevent-patched
        supervisor.start()
    assert supervisor.status()[0]["pid"] is None  # nothing was spawned


@pytest.mark.integration
def test_process_titles_name_their_shard(server) -> None:
    assert sorted(worker_procs(server)) == list(range(WORKERS))


@pytest.mark.integration
def test_each_worker_freezes_its_boot_objects_before_serving(server) -> None:
    """(webapp.gcboot: a full collection no longer walks the modules and the tokenizer.)"""
    for shard in range(WORKERS):
        line = re.search(rf"worker\[{shard}/{WORKERS}\]: (\d+) boot objects frozen", server.output())
        assert line is not None and int(line.group(1)) > 10_000, server.output()[-2000:]


@pytest.mark.integration
def test_each_worker_keeps_freed_memory_for_the_next_turn(server) -> None:
    """(webapp.allocator: a screenshot turn's multi-MiB buffers reuse mapped pages.)"""
    for shard in range(WORKERS):
        assert f"worker[{shard}/{WORKERS}]: malloc keeps freed memory" in server.output(), server.output()[-2000:]


@pytest.mark.integration
def test_killed_worker_fails_only_its_shard_and_is_restarted(server) -> None:
    base = server.url
    owned = sessions_by_shard(base)
    for sid in owned.values():
        assert chat(base, sid).status_code == 200
    before = requests.get(f"{base}/sessions/{owned[0]}", timeout=10).content
    victim = worker_procs(server)[0]
    victim.kill()
    victim.wait(10)
    down = requests.get(f"{base}/sessions/{owned[0]}", timeout=10)
    assert down.status_code == 503
    assert "shard 0" in down.json()["error"]
    for shard in (1, 2):  # other shards keep their sessions and serve
        assert chat(base, owned[shard]).status_code == 200
        assert requests.get(f"{base}/sessions/{owned[shard]}", timeout=10).status_code == 200
    wait_healthy(base)
    replacement = worker_procs(server)[0]
    assert replacement.pid != victim.pid
    # The replacement reopened the shard's journals: the session is back, byte for byte.
    assert requests.get(f"{base}/sessions/{owned[0]}", timeout=10).content == before
    assert chat(base, owned[0]).status_code == 200
    fresh = sessions_by_shard(base)[0]
    assert chat(base, fresh).status_code == 200


@pytest.mark.integration
def test_hung_worker_is_detected_killed_and_restarted(server) -> None:
    base = server.url
    wait_healthy(base)
    owned = sessions_by_shard(base)
    victim = worker_procs(server)[1]
    victim.suspend()  # SIGSTOP: alive, but answers nothing
    try:
        started = time.monotonic()
        hung = requests.get(f"{base}/sessions/{owned[1]}", timeout=RECOVERY_LIMIT)
        # answered (503 once the missed heartbeats mark the shard down), never left hanging
        assert hung.status_code == 503, hung.text
        assert time.monotonic() - started < RECOVERY_LIMIT
        assert chat(base, owned[2]).status_code == 200
        wait_healthy(base)
        assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
        assert worker_procs(server)[1].pid != victim.pid
    finally:
        if victim.is_running():
            victim.kill()


@pytest.mark.integration
def test_router_death_takes_its_workers_and_sigterm_leaves_nothing(reference_backend_factory,
                                                                    session_server_factory) -> None:
    backend = reference_backend_factory()
    server = session_server_factory.launch(2, backend.url)
    first = worker_procs(server, 2)
    assert len(first) == 2
    router = first[0].parent()
    assert "gunicorn: worker" in " ".join(router.cmdline())
    os.kill(router.pid, signal.SIGKILL)  # the router dies without any cleanup
    _gone, alive = psutil.wait_procs(list(first.values()), timeout=15)
    assert alive == []
    wait_healthy(server.url)  # gunicorn's master booted a new router with new workers
    assert len(worker_procs(server, 2)) == 2
    server.close()
    assert server.proc.returncode == 0
    assert server.leftovers == []  # the graceful stop alone left nothing (close SIGKILLs the rest)


@pytest.mark.integration
def test_a_worker_that_cannot_boot_leaves_its_shard_failed_with_the_reason(reference_backend_factory,
                                                                          tmp_path) -> None:
    """A bad --tokenizer: each worker answers its startup ping with the reason and exits with
    EXIT_BOOT_ERROR; after boot_attempts of them the shard is failed (not respawned every 5 s)."""
    backend = reference_backend_factory()
    missing = tmp_path / "no-such-tokenizer"
    script = textwrap.dedent(f"""
        from gevent import monkey; monkey.patch_all()
        import gevent, json
        from webapp.router import RouterConfig, create_app, start_supervisor, stop_supervisor
        app = create_app(RouterConfig(workers=2, boot_attempts=2,
                                      core={{"backend_url": {backend.url!r}, "tokenizer": {str(missing)!r}}}))
        start_supervisor(app)
        supervisor = app.extensions["shinken_supervisor"]
        with gevent.Timeout(90):
            while any(slot["state"] != "failed" for slot in supervisor.status()):
                gevent.sleep(0.05)
        codes = [slot.process.exitcode for slot in supervisor._slots]
        gevent.sleep(1.5)  # a respawn loop would have started another worker by now
        health = app.test_client().get("/health")
        chat = app.test_client().post("/sessions")
        # A probe that raced the last boot attempt saw the shard "starting", not yet failed: the
        # slot's reason, read after the probes, is what /health reports for a failed shard.
        from webapp.supervisor import ShardUnavailable
        def stale_probe(shard, meta, body=b"", **kw):
            raise ShardUnavailable(shard, "worker starting")
        supervisor.request = stale_probe
        raced = app.test_client().get("/health").get_json()
        print(json.dumps({{"status": supervisor.status(), "codes": codes, "health": health.status_code,
                          "body": health.get_json(), "create": chat.status_code, "raced": raced}}))
        stop_supervisor(app)
    """)
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["codes"] == [EXIT_BOOT_ERROR, EXIT_BOOT_ERROR]
    for slot in result["status"]:
        assert slot["state"] == "failed" and slot["restarts"] == 1  # two attempts, then no more
        assert "could not boot (2 attempts)" in slot["reason"] and str(missing) in slot["reason"]
    assert result["health"] == 503 and result["body"]["failed_shards"] == [0, 1]
    assert str(missing) in result["body"]["error"]
    assert result["create"] == 503
    assert result["raced"]["failed_shards"] == [0, 1]
    assert result["raced"]["error"].count("could not boot") == 2 and "worker starting" not in result["raced"]["error"]


@pytest.mark.integration
def test_the_launcher_refuses_a_bad_tokenizer_at_once(reference_backend_factory, tmp_path) -> None:
    # Before the workers start, as one usage line (before: a shard whose workers could not boot,
    # with a traceback per worker, or "/health never answered 200" after the whole ready deadline).
    backend = reference_backend_factory()
    missing = tmp_path / "no-such-tokenizer"
    run = subprocess.run(server_argv(1, backend.url, "127.0.0.1:0", "--tokenizer", str(missing)),
                         check=False, capture_output=True, text=True, timeout=150)
    assert run.returncode == 2, run.stderr[-3000:]
    (line,) = run.stderr.strip().splitlines()
    assert str(missing) in line and "is not a directory" in line
