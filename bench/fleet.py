"""The fleet gates: the seed's N=64/256/1024 staged validation plan, run for real.

One local process drives N sandboxes of a fleet host (``shinkend --fleet N``,
a separate process on loopback with emulated RTT) through the pull-based round
loop: every round, every sandbox runs one pipelined
``step([click], observe=JPEG q80 @1280)``, rounds paced at 1 Hz. Two faces:

* ``sync``  -- the blocking ``Sandbox`` facade on one ``SharedLoop``; the
  callers are gevent greenlets (one per sandbox, ``--callers gevent``, the
  headline idiom) or OS threads (``--callers threads``);
* ``async`` -- ``AsyncSandbox`` and ``asyncio.gather`` on one loop.

``--clicks shared`` (default) has every sandbox click the same empty spot,
moving each round, so the host's shared encode cache renders each round's
screen once and the client, not the one-process host emulator, is what is
measured; ``--clicks random`` makes the host encode every observation.

Each (N, face) measurement runs in a fresh client interpreter (this file with
``--child``): gevent's monkey-patching must precede every other import, and a
fresh process gives clean RSS, thread and fd baselines. The client of a
measurement is still one process driving all N sandboxes.

Drills (``--drills``, async core, on ``--drill-n``, default 256):

* stall: screencasts on every sandbox with the 256 MiB frame budget on; the
  consumers of 10% stop reading. Checks used <= budget, evictions confined to
  the stalled sandboxes, the others' round times unaffected. Because 10% of
  N=256 x 32-frame queues cannot fill 256 MiB, a third phase shrinks the
  budget until it bites, so confinement is tested with real evictions.
* storm: abort the TCP transports of 25% of the connections, reconnect them
  with full-jitter exponential backoff and ``resume_screencast``; convergence
  time and the survivors' round times.
* keepalive: pings per 100 ms tick across the fleet with ping jitter off and on.

Prints a table per run and PASS/FAIL per gate (exit status 1 on any FAIL);
``--json OUT`` writes everything. See docs/fleet-gates.md.

One module per concern: ``fleet_measure.py`` (constants, /proc readers, the
click workload, round pacing, the run report), ``fleet_faces.py`` (one round
runner over a small driver per face), ``fleet_drills.py``, ``fleet_floor.py`` (the
raw-recv floor), ``fleet_memory.py`` (RSS beside a thread-per-connection
client), ``fleet_gates.py`` (every verdict); this file starts the fleet host
(the SDK's ``LocalFleetProvider``) and the child processes, and prints.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bench/ is this script's directory: on sys.path when run as a script (parent and children).
from fleet_drills import DRILLS
from fleet_faces import AsyncFace, Callers, SyncFace, run_face
from fleet_gates import evaluate_gates, exit_status, format_gates
from fleet_measure import (
    CHILD_TIMEOUT_S,
    DEFAULT_NS,
    DEFAULT_ROUNDS,
    DEFAULT_RTT_MS,
    DRILL_MODES,
    HOST_READY_TIMEOUT_S,
    KB,
    MB,
    OBSERVE,
    PING_JITTER_S,
    PING_TICK_S,
    ROUND_PERIOD_S,
    Clicks,
    async_loop_name,
    cpu_seconds,
    proc_status,
    raise_fd_limit,
)
from fleet_turns import format_turns

# ---------------------------------------------------------------------------
# Child entry point


def _own_loop_runner(spec: dict[str, Any]) -> Any:
    """The async face's loop, as an ``asyncio.Runner``: by default uvloop under
    ``--transport fast`` (what the [fast] extra's users would run), else asyncio's
    own; ``--async-loop asyncio|uvloop`` picks one whatever the transport (so the
    two transports can be compared on the same loop), ``fair`` the SDK's
    bounded-select loop (``sharedloop.new_fair_event_loop``)."""
    import asyncio

    choice = async_loop_name(spec)
    if choice == "uvloop":
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    if choice == "fair":
        from shinken_sync.sharedloop import new_fair_event_loop

        return asyncio.Runner(loop_factory=new_fair_event_loop)
    return asyncio.Runner()


def _run_on_own_loop(spec: dict[str, Any], coro: Any) -> Any:
    with _own_loop_runner(spec) as runner:
        return runner.run(coro)


def _child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec["face"] == "sync" and spec.get("callers") == "gevent":
        from gevent import monkey

        monkey.patch_all()
        import gevent

        gevent.get_hub()  # before the loop thread imports anything (gevent-notes)
        import asyncio  # pre-imported for the same reason
        import ssl

        import websockets

        del asyncio, ssl, websockets
    raise_fd_limit()
    random.seed(spec.get("seed"))
    import shinken_sync.transport

    shinken_sync.transport.TRANSPORT = spec.get("transport", "websockets")
    shinken_sync.transport.choose()  # import the client library before any RSS baseline is read
    mode = spec["mode"]
    if mode == "rounds":
        if spec["face"] == "sync":
            report = run_face(spec, SyncFace(spec))
        elif spec["face"] == "floor":
            import fleet_floor

            clicks = Clicks(spec["clicks"], 1920, 1080)

            def actions_of(k: int) -> list[dict[str, Any]]:
                clicks.next_round()
                return clicks.actions(spec["actions"])

            report = fleet_floor.run_floor(spec, actions_of, OBSERVE, cpu_seconds)
        else:
            with _own_loop_runner(spec) as runner:
                report = run_face(spec, AsyncFace(spec, runner))
    elif mode == "memory":
        import fleet_memory

        def rss() -> int:
            return proc_status()["VmRSS"]

        if spec["face"] == "sync":
            callers = Callers(spec["callers"], spec["n"])
            report = fleet_memory.memory_sync(spec, rss, callers)
        elif spec["face"] == "wsclient":
            report = fleet_memory.memory_wsclient(spec, rss)
        else:
            report = _run_on_own_loop(spec, fleet_memory.memory_async(spec, rss))
    else:
        report = _run_on_own_loop(spec, DRILLS[mode](spec))
    Path(spec["out"]).write_text(json.dumps(report))


# ===========================================================================
# Parent side: fleet host, child runs, gates, the printed report
# ===========================================================================


def run_child(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run one measurement in a fresh client interpreter; its report, or an error record."""
    tag = f"{spec['mode']}-{spec['n']}-{spec['face']}-{spec.get('transport', 'websockets')}"
    spec_path = workdir / f"{tag}.spec.json"
    spec = {**spec, "out": str(workdir / f"{tag}.out.json")}
    spec_path.write_text(json.dumps(spec))
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(spec_path)],
        capture_output=True, timeout=CHILD_TIMEOUT_S, check=False,
    )  # fmt: skip
    elapsed = time.monotonic() - t
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace")[-3000:]
        return {"mode": spec["mode"], "n": spec["n"], "face": spec["face"], "error": tail,
                "elapsed_s": elapsed}  # fmt: skip
    report = json.loads(Path(spec["out"]).read_text())
    report["elapsed_s"] = elapsed
    return report


# ---------------------------------------------------------------------------
# Printing


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / MB:.0f}"


def format_round_report(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"N={r['n']} {r['face']}: FAILED TO RUN\n{r['error']}"
    rw, ol, lag = r["round_wall_s"], r["observe_latency_s"], r["loop_lag_s"]
    lines = [
        (f"N={r['n']} face={r['face']}({r['callers']}) transport={r.get('transport', 'websockets')} "
         f"actions={r.get('actions_per_step', 1)}+observe clicks={r['clicks']} rtt={r['rtt_ms']:g}ms "
         f"rounds={r['rounds']} connected={r['connected']} in {r['connect_s']:.1f}s "
         f"errors={r['connect_errors'] or 0}"),
        (f"  round wall p50/p95       {_ms(rw['p50'])} / {_ms(rw['p95'])} ms  (max {_ms(rw['max'])}, "
         f"late {r['late_rounds']}/{r['rounds']}, {r['achieved_hz']:.2f} Hz)"),
        f"  observe p50/p95/p99      {_ms(ol['p50'])} / {_ms(ol['p95'])} / {_ms(ol['p99'])} ms",
        (f"  loop lag p99             {_ms(lag['p99'])} ms (max {_ms(lag['max'])})"
         + (f"; gevent hub lag p99 {_ms(r['hub_lag_s']['p99'])} ms" if "hub_lag_s" in r else "")),
        (f"  RSS before/conn/after    {_mb(r['rss_before_bytes'])} / {_mb(r['rss_connected_bytes'])} / "
         f"{_mb(r['rss_after_bytes'])} MiB; marginal {r['marginal_rss_connect_bytes'] / KB:.0f} KiB/sb "
         f"at connect, {r['marginal_rss_steady_bytes'] / KB:.0f} KiB/sb steady"),
        f"  threads {r['threads']}, fd high-water {r['fd_high_water']} (soft limit {r['fd_soft_limit']})",
        (f"  frames dropped/evicted   {r['frames_dropped']} / {r['frames_evicted']} "
         f"(budget {_mb(r['budget_limit_bytes'])} MiB, used at end {r['budget_used_bytes']} B)"),
        (f"  throughput               {r['mbps']:.1f} Mbps ({r['observations']} frames, "
         f"avg {r['frame_bytes_avg'] / KB:.1f} KiB)"),
        (f"  cpu client/host          {r['client_cpu_pct']:.0f}% / {r['host_cpu_pct']:.0f}% of a core, "
         f"{r['client_cpu_ms_per_step']:.2f} / {r['host_cpu_ms_per_step']:.2f} ms per step "
         f"(host RSS {_mb(r['host_rss_bytes'])} MiB); machine load avg up to {r['loadavg_max']:.1f}"),
        (f"  gc during rounds         {r['gc_collections']} collections ({r['gc_gen2_collections']} gen2), "
         f"longest pause {_ms(r['gc_pause_max_s'])} ms"
         + (" (heap frozen after connect)" if r["gc_freeze"] else "")),
        f"  step outcomes            {r['step_outcomes']}",
        *([line] if (line := format_turns(r)) else []),
        *([f"  TEARDOWN FAILED          {r['teardown_error']}"] if "teardown_error" in r else []),
        (f"  sustained 1 Hz           {'yes' if r['sustained_1hz'] else 'NO'}"
         + (f" (steps spread over {r['spread_ms']:g} ms of each round)" if r["spread_ms"] else "")),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Main


def git_revision() -> str:
    """The commit the measured code is at, "+dirty" when the tree differs (the
    SDK changes between runs; results are only comparable at one revision)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "shinken_sync"],
                               cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default=",".join(map(str, DEFAULT_NS)), help="fleet sizes, comma-separated")
    p.add_argument("--rtt-ms", type=float, default=DEFAULT_RTT_MS, help="emulated round-trip time")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="measured rounds per run")
    p.add_argument("--face", choices=("sync", "async", "both"), default="both")
    p.add_argument("--callers", choices=("gevent", "threads"), default="gevent",
                   help="what drives the sync facade's Sandboxes")  # fmt: skip
    p.add_argument("--clicks", choices=("shared", "random"), default="shared",
                   help="shared: one spot per round for all (the host encodes once); "
                   "random: the host encodes every observation")
    p.add_argument("--spread-ms", type=float, default=0.0,
                   help="start each round's steps evenly over this window instead of all at once")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.collect(); gc.freeze() once the fleet is connected (caller-side idiom)")
    p.add_argument("--actions", type=int, default=1,
                   help="actions per step before the observation (moves, then a click)")
    p.add_argument("--gc-fleet", action="store_true",
                   help="shinken_sync.tune_gc_for_fleet() once the fleet is connected (freeze + thresholds)")
    p.add_argument("--transport", choices=("websockets", "fast", "both"), default="websockets",
                   help="the SDK's transport: websockets, the [fast] extra (picows + uvloop), or both in turn")
    p.add_argument("--async-loop", choices=("default", "asyncio", "uvloop", "fair"), default="default",
                   help="the async face's loop: default = uvloop under --transport fast, else asyncio.run's; "
                   "asyncio or uvloop whatever the transport; fair = "
                   "shinken_sync.sharedloop.new_fair_event_loop (bounded ready sockets per select)")
    p.add_argument("--spawn-callers", action="store_true",
                   help="sync face with gevent: a new greenlet per step every round (the driver before "
                   "long-lived callers; costs the callers' thread an mmap/munmap pair per step)")
    p.add_argument("--trace-turns", action="store_true",
                   help="time each turn of the face's loop on and off the CPU (bench/fleet_turns.py; asyncio loops)")
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="skip the raw-recv floor run that follows each N's faces")
    p.add_argument("--memory", default="",
                   help="fleet sizes for the marginal-RSS comparison: sync, async, websocket-client threads")
    p.add_argument("--drills", nargs="?", const=",".join(DRILL_MODES), default="",
                   help=f"run drills: all, or a comma-separated subset of {','.join(DRILL_MODES)}")
    p.add_argument("--drill-n", type=int, default=256, help="fleet size for the drills")
    p.add_argument("--period", type=float, default=ROUND_PERIOD_S, help="round period, seconds")
    p.add_argument("--keepalive-interval", type=float, default=0.0,
                   help="keepalive drill: base ping interval instead of the SDK's 20 s (short CI runs)")
    p.add_argument("--keepalive-jitter", type=float, default=0.0,
                   help=f"keepalive drill: ping_jitter of the jitter-on phase (default {PING_JITTER_S:g} s)")
    p.add_argument("--json", dest="json_out", help="write the full report here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from shinken_sync.providers.local import LocalFleetProvider

    args = parse_args(argv)
    if args.child:
        _child_main(args.child)
        return 0
    soft, hard = raise_fd_limit()
    ns = [int(x) for x in args.n.split(",") if x.strip()]
    drill_modes = [m for m in args.drills.split(",") if m]
    unknown = set(drill_modes) - set(DRILL_MODES)
    if unknown:
        raise SystemExit(f"unknown drill(s) {sorted(unknown)}; choose from {', '.join(DRILL_MODES)}")
    faces = ["sync", "async"] if args.face == "both" else [args.face]
    transports = ["websockets", "fast"] if args.transport == "both" else [args.transport]
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    revision = git_revision()
    print(f"fleet gates {started}: N={ns} faces={faces} clicks={args.clicks} rtt={args.rtt_ms:g}ms "
          f"rounds={args.rounds} period={args.period:g}s actions={args.actions} gc_freeze={args.gc_freeze} gc_fleet={args.gc_fleet} "
          f"spread={args.spread_ms:g}ms fd limit {soft}/{hard} code {revision}", flush=True)  # fmt: skip
    for n in ns:
        if soft < 4 * n:
            print(f"warning: nofile soft limit {soft} < 4 x N = {4 * n}", flush=True)
    runs: list[dict[str, Any]] = []
    floors: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    memory_ns = [int(x) for x in args.memory.split(",") if x.strip()]
    drills: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        workdir = Path(tmp)
        drill_ns = {args.drill_n} if drill_modes else set()
        for n in sorted(set(ns) | drill_ns | set(memory_ns)):
            t = time.monotonic()
            # The SDK's own fleet provider: shinkend --fleet N, its readiness and its teardown.
            with LocalFleetProvider(n, rtt_ms=args.rtt_ms, start_timeout=HOST_READY_TIMEOUT_S) as host:
                print(f"\nfleet host N={n} ready in {time.monotonic() - t:.1f}s (pid {host.pid})", flush=True)
                sandboxes = host.create_many(n)
                base = {
                    "mode": "rounds", "n": n, "urls": [sb.url for sb in sandboxes], "token": sandboxes[0].token,
                    "rtt_ms": args.rtt_ms, "rounds": args.rounds, "period": args.period, "host_pid": host.pid,
                    "ping_jitter": PING_JITTER_S if n >= 256 else 0.0, "callers": args.callers, "seed": n,
                    "clicks": args.clicks, "gc_freeze": args.gc_freeze, "gc_fleet": args.gc_fleet,
                    "actions": args.actions, "keepalive_interval": args.keepalive_interval,
                    "async_loop": args.async_loop, "trace_turns": args.trace_turns,
                    "spawn_callers": args.spawn_callers,
                    "keepalive_jitter": args.keepalive_jitter,
                    "spread_ms": args.spread_ms,
                }  # fmt: skip
                if n in ns:
                    for transport in transports:
                        for face in faces:
                            report = run_child({**base, "face": face, "transport": transport}, workdir)
                            runs.append(report)
                            print(format_round_report(report), flush=True)
                    if args.floor:
                        floor = run_child({**base, "face": "floor"}, workdir)
                        floors.append(floor)
                        print(format_floor(floor, runs), flush=True)
                if n in memory_ns:
                    for client in ("sync", "async", "wsclient"):
                        report = run_child({**base, "mode": "memory", "face": client}, workdir)
                        memory.append(report)
                    print(format_memory([m for m in memory if m["n"] == n]), flush=True)
                if n in drill_ns:
                    for mode in drill_modes:
                        report = run_child({**base, "mode": mode, "face": "async"}, workdir)
                        drills[mode] = report
                        print(format_drill(mode, report), flush=True)
    gates = evaluate_gates(runs, drills, args.rtt_ms, memory)
    print("\ngates (seed section 7 targets):")
    print(format_gates(gates))
    if args.json_out:
        out = {"started": started, "revision": revision, "argv": sys.argv, "rtt_ms": args.rtt_ms, "runs": runs,
               "floors": floors, "memory": memory, "drills": drills, "gates": gates}  # fmt: skip
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    status = exit_status(gates)
    if status:
        print("\nat least one gate FAILED (exit status 1)", flush=True)
    return status


def format_floor(floor: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    if "error" in floor:
        return f"raw-recv floor N={floor['n']}: FAILED TO RUN\n{floor['error']}"
    base = floor["client_cpu_ms_per_step"]
    same = [r for r in runs if r["n"] == floor["n"] and "error" not in r]
    # CPU time comes in 10 ms ticks: a tiny run can measure 0
    ratios = ", ".join(f"{r['face']} {r['client_cpu_ms_per_step'] / base:.1f}x" if base else f"{r['face']} -"
                       for r in same)  # fmt: skip
    return (f"raw-recv floor N={floor['n']}: {base * 1000:.0f} us CPU per step (plain sockets, recv_into, no "
            f"decoding), round p50 {_ms(floor['round_wall_p50_s'])} ms; the faces above: {ratios}")


def format_memory(rows: list[dict[str, Any]]) -> str:
    lines = [f"marginal RSS per sandbox, N={rows[0]['n']}, {rows[0].get('screenshots_per_sandbox')} screenshots each:"]
    for m in rows:
        if "error" in m:
            lines.append(f"  {m.get('face', '?'):<9} FAILED TO RUN: {m['error'][-300:]}")
            continue
        lines.append(f"  {m['client']:<9} {m['marginal_steady_bytes'] / KB:6.0f} KiB steady "
                     f"({m['marginal_connect_bytes'] / KB:.0f} KiB at connect), {m['threads']} threads")
    return "\n".join(lines)


def format_drill(mode: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{mode} drill N={r['n']}: FAILED TO RUN\n{r['error']}"
    if mode == "stall":
        lines = [(f"stall drill N={r['n']}: {r['stalled']} of {r['connected']} consumers stalled; "
                  f"screencast {r['screencast']}")]  # fmt: skip
        for name, ph in r["phases"].items():
            rw = ph["others_round_wall_s"]
            ratio = ph.get("others_round_p50_ratio")
            lines.append(
                f"  {name:<22} budget {ph['budget_limit_bytes'] / MB:7.1f} MiB, used max "
                f"{ph['budget_used_max_bytes'] / MB:6.1f} MiB; evicted stalled/others "
                f"{ph['evicted_stalled']}/{ph['evicted_others']}; others' round p50/p95 "
                f"{_ms(rw['p50'])}/{_ms(rw['p95'])} ms" + (f" ({ratio:.2f}x baseline)" if ratio else "")
                + f"; client cpu {ph['client_cpu_ms_per_step']:.2f} ms/step, load {ph['loadavg_max']:.1f}"
            )
        lines.append(f"  frames dropped by the 32-frame bound: {r['frames_dropped_total']}; "
                     f"step outcomes {r['step_outcomes']}")  # fmt: skip
        return "\n".join(lines)
    if mode == "storm":
        b, d = r["survivors_round_wall_before_s"], r["survivors_round_wall_during_s"]
        conv = r["convergence_s"]
        ratio = r["survivors_round_p50_ratio"]
        return "\n".join([
            (f"storm drill N={r['n']}: killed {r['killed']} of {r['connected']} connections, "
             f"recovered {r['recovered']}, convergence {'-' if conv is None else f'{conv:.1f} s'}"),
            (f"  recovery p50/max {_ms(r['recovery_s']['p50'])}/{_ms(r['recovery_s']['max'])} ms; attempts "
             f"p50/max {r['reconnect_attempts']['p50']}/{r['reconnect_attempts']['max']}; failed attempts "
             f"{r['reconnect_failures'] or 0}; resumed seq gap p50/max {r['resumed_seq_gap']['p50']}/"
             f"{r['resumed_seq_gap']['max']}"),
            (f"  survivors' round p50/p95 before {_ms(b['p50'])}/{_ms(b['p95'])} ms, during "
             f"{_ms(d['p50'])}/{_ms(d['p95'])} ms" + (f" ({ratio:.2f}x)" if ratio else "")
             + f"; client cpu {r['client_cpu_ms_per_step_before']:.2f} / "
             f"{r['client_cpu_ms_per_step_during']:.2f} ms/step (incl. reconnects)"),
            f"  step outcomes {r['step_outcomes']}; the victims' losses classified as {r.get('loss_outcomes')}",
        ])  # fmt: skip
    lines = [(f"keepalive drill N={r['n']}: base ping interval {r['ping_interval_s']:g} s, pings per "
              f"{r.get('tick_s', PING_TICK_S) * 1000:.0f} ms tick across the fleet")]  # fmt: skip
    for label in ("jitter_off", "jitter_on"):
        ph = r[label]
        lines.append(
            f"  ping_jitter={ph['ping_jitter_s']:<4g} {ph['pings']} pings in {ph['window_s']:.0f} s over "
            f"{ph['busy_ticks']} ticks; max {ph['max_pings_per_tick']} per tick (N/10 = "
            f"{ph['target_max_per_tick']:.0f})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
