"""The fleet gates: every PASS/FAIL verdict bench/fleet.py prints, from its report alone.

Pure functions over the JSON report (no processes, no clocks), so
``tests/bench/test_fleet_gates.py`` checks each verdict both ways on made-up
reports, and the small-N drill runs there feed real reports through the same
functions. Two kinds of gate:

* **invariants** -- must hold at any N on any machine: used <= budget,
  evictions only on stalled streams, every storm victim recovers and none is
  reported dead, keepalive pings per tick within N/10 (with jitter), zero
  evictions under pull, no step failed. CI checks these on small N.
* **timing** -- loop lag, round times, 1 Hz, CPU per step: figures of this
  machine at that moment. Evaluated and printed by the bench (its exit status
  counts them), never asserted by a test.

``bench/fleet.py`` exits 1 when any gate FAILs.
"""

from __future__ import annotations

from typing import Any

KB = 1024
MB = 1024 * 1024

# Gate targets (seed section 7)
GATE_ROUND_RTT_FACTOR = 2.0
GATE_MARGINAL_RSS_BYTES = 1 << 20
GOAL_MARGINAL_RSS_BYTES = 100 << 10  # below a thread-per-connection client, <= 100 KiB
#: Loop-lag p99 targets at N=1024: one action + observe per step, and more (the seed's 50 ms).
GATE_LOOP_LAG_P99_S = {1: 0.020, "more": 0.050}
#: CPU per step at N=1024, by transport.
GATE_CPU_PER_STEP_S = {"websockets": 150e-6, "fast": 100e-6}
GATE_STORM_CONVERGENCE_S = 60.0
#: A drill leaves the others "unaffected" when their round p50 stays within
#: this factor of the phase before (a shared 2-core machine is noisy).
UNAFFECTED_RATIO = 1.25
SUSTAINED_LATE_FRACTION = 0.05  # "sustained 1 Hz": at most 5% of rounds overrun their slot
#: Keepalive target: at most N/10 pings in any 100 ms tick with jitter on.
KEEPALIVE_FRACTION_PER_TICK = 0.10

INVARIANT = "invariant"
TIMING = "timing"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def loop_lag_target(actions_per_step: int) -> float:
    return GATE_LOOP_LAG_P99_S[1] if actions_per_step <= 1 else GATE_LOOP_LAG_P99_S["more"]


def pings_per_tick(sent: list[float], t0: float, tick: float) -> dict[int, int]:
    """Histogram of ping send times over ``tick``-second slots counted from ``t0``."""
    ticks: dict[int, int] = {}
    for t in sent:
        slot = int((t - t0) / tick)
        ticks[slot] = ticks.get(slot, 0) + 1
    return ticks


def keepalive_target(connected: int) -> float:
    return connected * KEEPALIVE_FRACTION_PER_TICK


def deaths_reported(outcomes: dict[str, int]) -> int:
    """Steps (or stream losses) a report counts as ``sandbox_died``, observe rows included."""
    return sum(count for kind, count in outcomes.items() if kind.endswith("sandbox_died"))


class Gates:
    """Collects gate rows: name, run, kind, verdict, value, target."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, name: str, where: str, ok: bool | None, value: str, target: str, kind: str = INVARIANT) -> None:
        verdict = "N/A" if ok is None else ("PASS" if ok else "FAIL")
        self.rows.append(
            {"gate": name, "run": where, "kind": kind, "verdict": verdict, "value": value, "target": target}
        )


def _run_gates(g: Gates, r: dict[str, Any], rtt_ms: float) -> None:
    where = f"N={r['n']} {r['face']}" + (f" {r['transport']}" if r.get("transport", "websockets") != "websockets" else "")
    if r.get("callers") == "fair loop":
        where += " fair-loop"
    if "error" in r:
        g.add("run completed", where, False, "crashed", "completes")
        return
    bad = {k: v for k, v in r["step_outcomes"].items() if k != "ok"}
    g.add("every step ok", where, not bad and not r["connect_errors"],
          f"{sum(bad.values())} failed {bad or ''}, connect errors {r['connect_errors'] or 0}", "0")  # fmt: skip
    marginal = max(r["marginal_rss_connect_bytes"], r["marginal_rss_steady_bytes"])
    g.add("marginal RSS <= 1 MiB/sandbox", where, marginal <= GATE_MARGINAL_RSS_BYTES,
          f"{marginal / KB:.0f} KiB (goal {GOAL_MARGINAL_RSS_BYTES // KB} KiB: "
          f"{'met' if marginal <= GOAL_MARGINAL_RSS_BYTES else 'missed'})", "<= 1024 KiB")  # fmt: skip
    g.add("zero evictions under pull", where, r["frames_evicted"] == 0, str(r["frames_evicted"]), "0")
    if r["n"] == 64:
        p50 = r["round_wall_s"]["p50"]
        target = GATE_ROUND_RTT_FACTOR * rtt_ms / 1000
        g.add("round p50 <= 2x RTT", where, p50 is not None and p50 <= target, f"{_ms(p50)} ms",
              f"<= {target * 1000:.0f} ms", TIMING)  # fmt: skip
    if r["n"] >= 1024:
        actions = r.get("actions_per_step", 1)
        target = loop_lag_target(actions)
        p99 = r["loop_lag_s"]["p99"]
        g.add(f"loop lag p99 < {target * 1000:.0f} ms ({actions} action(s) + observe)", where,
              p99 is not None and p99 < target, f"{_ms(p99)} ms", f"< {target * 1000:.0f} ms", TIMING)  # fmt: skip
        g.add("sustained 1 Hz rounds", where, r["sustained_1hz"],
              f"late {r['late_rounds']}/{r['rounds']}, p95 {_ms(r['round_wall_s']['p95'])} ms",
              "<= 5% rounds over 1 s, no errors", TIMING)  # fmt: skip
        if actions <= 1:
            cpu_target = GATE_CPU_PER_STEP_S.get(r.get("transport", "websockets"))
            cpu = r["client_cpu_ms_per_step"] / 1000
            if cpu_target is not None:
                g.add("client CPU per step", where, cpu <= cpu_target, f"{cpu * 1e6:.0f} us",
                      f"<= {cpu_target * 1e6:.0f} us", TIMING)  # fmt: skip


def _stall_gates(g: Gates, stall: dict[str, Any]) -> None:
    where = f"N={stall['n']} drill"
    if "error" in stall:
        g.add("stall drill completed", where, False, "crashed", "completes")
        return
    base_cpu = stall["phases"]["baseline"]["client_cpu_ms_per_step"]
    for name, ph in stall["phases"].items():
        if name == "baseline":
            continue
        g.add(f"stall[{name}]: used <= budget", where, ph["used_within_budget"],
              f"{ph['budget_used_max_bytes'] / MB:.1f} MiB", f"<= {ph['budget_limit_bytes'] / MB:.1f} MiB")
        confined = ph["evicted_others"] == 0
        g.add(f"stall[{name}]: evictions confined to stalled", where,
              confined if ph["evicted_stalled"] or not confined else None,
              f"{ph['evicted_stalled']} stalled / {ph['evicted_others']} others",
              "others 0 (N/A when nothing was evicted)")  # fmt: skip
        ratio = ph["others_round_p50_ratio"]
        g.add(f"stall[{name}]: others' round unaffected", where, ratio is not None and ratio <= UNAFFECTED_RATIO,
              "-" if ratio is None else f"p50 {ratio:.2f}x baseline", f"<= {UNAFFECTED_RATIO}x", TIMING)
        # the same question asked of CPU per step, which the machine's load does not move
        cpu = ph["client_cpu_ms_per_step"] / max(1e-9, base_cpu)
        g.add(f"stall[{name}]: no extra client CPU per step", where, cpu <= UNAFFECTED_RATIO,
              f"{cpu:.2f}x baseline", f"<= {UNAFFECTED_RATIO}x", TIMING)
    # the tight phase exists to make eviction happen: if it did not, confinement went untested
    tight = stall["phases"].get("stalled_tight_budget")
    if tight is not None:
        g.add("stall: the tight budget evicted", where, tight["evicted_stalled"] + tight["evicted_others"] > 0,
              str(tight["evicted_stalled"] + tight["evicted_others"]), "> 0")


def _storm_gates(g: Gates, storm: dict[str, Any]) -> None:
    where = f"N={storm['n']} drill"
    if "error" in storm:
        g.add("storm drill completed", where, False, "crashed", "completes")
        return
    g.add("storm: every victim recovers", where, storm["recovered"] == storm["killed"] > 0,
          f"{storm['recovered']} of {storm['killed']}", "all")
    deaths = deaths_reported(storm["step_outcomes"]) + deaths_reported(storm.get("loss_outcomes", {}))
    g.add("storm: no disconnected sandbox reported dead", where, deaths == 0,
          f"{deaths} sandbox_died; losses {storm.get('loss_outcomes', {})}", "0 (they were only disconnected)")
    conv = storm["convergence_s"]
    g.add("storm convergence < 60 s", where, conv is not None and conv < GATE_STORM_CONVERGENCE_S,
          "-" if conv is None else f"{conv:.1f} s", "< 60 s", TIMING)
    ratio = storm["survivors_round_p50_ratio"]
    g.add("storm: survivors' round unaffected", where, ratio is not None and ratio <= UNAFFECTED_RATIO,
          "-" if ratio is None else f"p50 {ratio:.2f}x before", f"<= {UNAFFECTED_RATIO}x", TIMING)


def _keepalive_gates(g: Gates, keepalive: dict[str, Any]) -> None:
    where = f"N={keepalive['n']} drill"
    if "error" in keepalive:
        g.add("keepalive drill completed", where, False, "crashed", "completes")
        return
    on, off = keepalive["jitter_on"], keepalive["jitter_off"]
    g.add("keepalive burst <= N/10 per tick (jitter on)", where,
          on["max_pings_per_tick"] <= on["target_max_per_tick"],
          f"{on['max_pings_per_tick']} (jitter off: {off['max_pings_per_tick']})",
          f"<= {on['target_max_per_tick']:.0f}")  # fmt: skip
    for label, ph in (("off", off), ("on", on)):
        # every connection keeps pinging: at least once per (longest) period of the window
        g.add(f"keepalive[jitter {label}]: every connection pinged", where,
              ph["pings"] >= ph["connected"] * ph.get("min_periods", 1),
              f"{ph['pings']} pings from {ph['connected']} connections",
              f">= {ph['connected'] * ph.get('min_periods', 1)}")  # fmt: skip


def _memory_gates(g: Gates, memory: list[dict[str, Any]]) -> None:
    """Ours below the thread-per-connection baseline of the same run, and <= the goal."""
    by_n: dict[int, dict[str, dict[str, Any]]] = {}
    for row in memory:
        by_n.setdefault(row["n"], {})[row.get("client", row.get("face", "?"))] = row
    for n, rows in sorted(by_n.items()):
        where = f"N={n} memory"
        failed = [name for name, row in rows.items() if "error" in row]
        if failed:
            g.add("memory comparison completed", where, False, f"crashed: {', '.join(failed)}", "completes")
            continue
        baseline = rows["wsclient"]["marginal_steady_bytes"]
        for client in ("sync", "async"):
            ours = rows[client]["marginal_steady_bytes"]
            g.add(f"marginal RSS ({client}) below thread-per-connection", where,
                  ours < baseline and ours <= GOAL_MARGINAL_RSS_BYTES,
                  f"{ours / KB:.0f} KiB vs websocket-client {baseline / KB:.0f} KiB",
                  f"< baseline and <= {GOAL_MARGINAL_RSS_BYTES // KB} KiB", TIMING)  # fmt: skip


def evaluate_gates(
    runs: list[dict[str, Any]], drills: dict[str, Any], rtt_ms: float, memory: list[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """One row per gate and measured run: gate, run, kind, verdict, value, target."""
    g = Gates()
    for r in runs:
        _run_gates(g, r, rtt_ms)
    _memory_gates(g, list(memory))
    if "stall" in drills:
        _stall_gates(g, drills["stall"])
    if "storm" in drills:
        _storm_gates(g, drills["storm"])
    if "keepalive" in drills:
        _keepalive_gates(g, drills["keepalive"])
    return g.rows


def exit_status(gates: list[dict[str, Any]]) -> int:
    """1 when any gate failed (invariant or timing), else 0."""
    return int(any(row["verdict"] == "FAIL" for row in gates))


def format_gates(gates: list[dict[str, Any]]) -> str:
    """The verdict table (tabulate, the benches' and the demo's one table library)."""
    from tabulate import tabulate

    rows = [(row["verdict"], row["gate"], row["run"], row["value"], f"(target {row['target']}; {row['kind']})")
            for row in gates]  # fmt: skip
    table = tabulate(rows, tablefmt="plain", disable_numparse=True)
    return "\n".join(f"  {line}" for line in table.splitlines())
