"""The opt-in GC setting for fleets: never applied on import, fully undoable.

Each check runs in a fresh interpreter: the collector's state is process-wide.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest

from shinken_sync.fleetgc import FLEET_GC_THRESHOLDS, FleetGcPolicy, auto_policy


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def test_importing_and_using_the_sdk_leaves_the_collector_alone():
    state = _run(
        "import gc, json\n"
        "before = [gc.get_threshold(), gc.get_freeze_count()]\n"
        "import shinken_sync, shinken_sync.sync, shinken_sync.client, shinken_sync.fleetgc\n"
        "from shinken_sync.sharedloop import SharedLoop\n"
        "loop = SharedLoop(); loop.loop; loop.close()\n"
        "print(json.dumps({'before': before, 'after': [gc.get_threshold(), gc.get_freeze_count()]}))\n"
    )
    # unchanged, not zero: some interpreters (3.12 in a venv) start with objects frozen already
    assert state["after"] == state["before"]


def test_tune_freezes_the_live_heap_raises_thresholds_and_undo_restores_both():
    state = _run(
        "import gc, json, shinken_sync\n"
        "keep = [[i] for i in range(5000)]  # a 'connected fleet' of long-lived objects\n"
        "default = gc.get_threshold()\n"
        "tuning = shinken_sync.tune_gc_for_fleet()\n"
        "tuned = [gc.get_threshold(), gc.get_freeze_count(), tuning.frozen_objects]\n"
        "tuning.undo()\n"
        "print(json.dumps({'default': default, 'tuned': tuned, 'undone': [gc.get_threshold(), gc.get_freeze_count()],\n"
        "                  'previous': tuning.previous_thresholds}))\n"
    )
    threshold, frozen, reported = state["tuned"]
    assert tuple(threshold) == FLEET_GC_THRESHOLDS
    assert frozen >= 5000 and reported == frozen
    assert state["undone"] == [state["default"], 0]
    assert state["previous"] == state["default"]


def test_thresholds_none_only_freezes():
    state = _run(
        "import gc, json\n"
        "from shinken_sync.fleetgc import tune_gc_for_fleet\n"
        "default = gc.get_threshold()\n"
        "tune_gc_for_fleet(thresholds=None)\n"
        "print(json.dumps({'default': default, 'now': gc.get_threshold(), 'frozen': gc.get_freeze_count()}))\n"
    )
    assert state["now"] == state["default"] and state["frozen"] > 0


# The automatic policy's decisions, on policy objects of their own; the
# collector's thresholds are restored by each test whatever happens.


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def _policy(**kw):
    return FleetGcPolicy(engage_at=4, release_below=2, thresholds=(5000, 15, 25), **kw)


def test_policy_engages_at_the_fleet_size_and_restores_below_the_release_mark(thresholds):
    policy = _policy()
    policy.report("a", 3)
    assert not policy.engaged and gc.get_threshold() == (700, 10, 10)
    policy.report("b", 1)  # the sum over loops counts
    assert policy.engaged and gc.get_threshold() == (5000, 15, 25)
    policy.report("b", 0)
    assert policy.engaged  # 3: hysteresis, still above the release mark
    policy.report("a", 1)
    assert not policy.engaged and gc.get_threshold() == (700, 10, 10)


def test_policy_leaves_thresholds_the_user_set_meanwhile(thresholds):
    policy = _policy()
    policy.report("a", 10)
    gc.set_threshold(900, 11, 12)
    policy.report("a", 0)
    assert not policy.engaged and gc.get_threshold() == (900, 11, 12)


def test_policy_does_not_engage_over_a_laxer_or_disabled_collector(thresholds):
    gc.set_threshold(20_000, 20, 50)  # e.g. tune_gc_for_fleet already applied
    policy = _policy()
    policy.report("a", 10)
    assert not policy.engaged and gc.get_threshold() == (20_000, 20, 50)
    gc.set_threshold(0)
    policy.report("a", 11)
    assert not policy.engaged


def test_disabled_policy_never_touches_the_collector_and_disable_restores(thresholds):
    off = _policy(enabled=False)
    off.report("a", 100)
    assert not off.engaged and gc.get_threshold() == (700, 10, 10)
    on = _policy()
    on.report("a", 100)
    on.disable()
    assert not on.engaged and gc.get_threshold() == (700, 10, 10)


def test_policy_rejects_release_above_engage():
    with pytest.raises(ValueError):
        FleetGcPolicy(engage_at=2, release_below=3)


def test_env_switches_the_automatic_policy_off():
    env_code = (
        "import json; from shinken_sync.fleetgc import auto_policy\n"
        "print(json.dumps({'enabled': auto_policy().enabled}))\n"
    )
    for value, expected in (("off", False), ("auto", True)):
        out = subprocess.run(
            [sys.executable, "-c", env_code],
            capture_output=True, text=True, check=True, timeout=60,
            env={**os.environ, "SHINKEN_FLEET_GC": value},
        )
        assert json.loads(out.stdout)["enabled"] is expected
    assert isinstance(auto_policy(), FleetGcPolicy)


def test_a_loop_reports_its_open_connections_and_the_closed_ones_release():
    state = _run(
        "import asyncio, gc, json\n"
        "from shinken_sync import fleetgc\n"
        "gc.set_threshold(700, 10, 10)\n"
        "policy = fleetgc.auto_policy(); policy.engage_at = 2; policy.release_below = 1\n"
        "class Conn:\n"
        "    pass\n"
        "async def main():\n"
        "    conns = [Conn(), Conn()]\n"
        "    for c in conns: fleetgc.host_connection(c)\n"
        "    engaged = [policy.engaged, gc.get_threshold()]\n"
        "    fleetgc.release_connection(conns[0]); fleetgc.release_connection(conns[0])  # idempotent\n"
        "    one_left = policy.engaged\n"
        "    fleetgc.release_connection(conns[1])\n"
        "    return engaged, one_left\n"
        "engaged, one_left = asyncio.run(main())\n"
        "print(json.dumps({'engaged': engaged, 'one_left': one_left, 'after': [policy.engaged, gc.get_threshold()]}))\n"
    )
    assert state["engaged"] == [True, list(FLEET_GC_THRESHOLDS)]
    assert state["one_left"] is True  # 1 open, not below release_below=1
    assert state["after"] == [False, [700, 10, 10]]


def test_hosting_a_fleet_costs_no_timer_and_no_scan():
    """Connects and releases report at once, each O(1): no recount timer walking the
    whole fleet on the loop every interval."""
    import asyncio

    from shinken_sync import fleetgc

    class Conn:
        pass

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        before = sum(1 for h in loop._scheduled if not h.cancelled())  # type: ignore[attr-defined]
        conns = [Conn() for _ in range(50)]
        for c in conns:
            fleetgc.host_connection(c, loop)
        timers = sum(1 for h in loop._scheduled if not h.cancelled())  # type: ignore[attr-defined]
        hosted = fleetgc.auto_policy().connections
        for c in conns:
            fleetgc.release_connection(c, loop)
        return timers - before, hosted

    timers, hosted = asyncio.run(main())
    assert timers == 0 and hosted >= 50
    assert fleetgc.auto_policy().connections == 0


def test_a_real_connection_is_counted_while_open():
    """AsyncSandbox reports itself on connect and releases on close (and on a loss)."""
    import asyncio

    from shinken_sync import fleetgc
    from shinken_sync.client import aconnect
    from shinken_sync.providers.local import LocalProvider

    async def main(url: str, token: str) -> list[int]:
        policy = fleetgc.auto_policy()
        counts = [policy.connections]
        sb = await aconnect(url, token)
        counts.append(policy.connections)
        await sb.close()
        counts.append(policy.connections)
        return counts

    with LocalProvider() as provider:
        handle = provider.create()
        counts = asyncio.run(main(handle.url, handle.token))
    assert counts[1] == counts[0] + 1 and counts[2] == counts[0]
