"""webapp.offload: blocking calls leave a gevent hub free, each lane at its own CPU priority."""

from __future__ import annotations

import json
import os
import threading

from tests.support import clean_stdout, run_script
from webapp.offload import LANES, run_blocking

GEVENT_SCRIPT = """
    from gevent import monkey; monkey.patch_all()
    import json, os, threading
    import gevent
    from webapp.offload import LANES, run_blocking

    def nice_of_this_thread():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), threading.get_native_id()

    from tests.support import start_hub_ticker

    ticks, ticking = start_hub_ticker(0.01)
    gevent.sleep(0.05)
    before = len(ticks)
    # A real blocking call (the unpatched sleep) in the journal lane: the hub keeps running.
    run_blocking("journal", monkey.get_original("time", "sleep"), 0.4)
    during = len(ticks) - before
    ticking.kill()
    lanes = {lane: run_blocking(lane, nice_of_this_thread) for lane in LANES}
    print(json.dumps({"during": during, "lanes": lanes, "main": threading.get_native_id(),
                      "base": os.getpriority(os.PRIO_PROCESS, os.getpid())}))
"""


def test_under_gevent_a_blocking_call_leaves_the_hub_free_and_each_lane_runs_at_its_nice() -> None:
    out = json.loads(clean_stdout(run_script(GEVENT_SCRIPT)))
    assert out["during"] >= 10  # ~40 ticks of 10 ms while a thread slept 0.4 s; 0 if the hub was held
    for lane, (nice, tid) in out["lanes"].items():
        assert tid != out["main"]
        assert nice == min(out["base"] + LANES[lane].nice, 19), (lane, nice)
    assert LANES["send"].nice > LANES["journal"].nice  # bulk copies yield to the turns' appends


def test_without_gevent_it_is_a_plain_call_at_the_callers_priority() -> None:
    me = threading.get_native_id()
    assert run_blocking("send", lambda: (threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0))) == (
        me, os.getpriority(os.PRIO_PROCESS, 0))


KILL_SCRIPT = """
    from gevent import monkey; monkey.patch_all()
    import json
    import gevent
    from webapp.offload import run_blocking

    real_sleep = monkey.get_original("time", "sleep")
    events = []

    def slow_copy():
        events.append("thread started")
        real_sleep(0.3)
        events.append("thread done")

    def caller():
        try:
            run_blocking("send", slow_copy)
        finally:
            events.append("caller cleanup")  # where a GET closes the descriptors the thread uses

    g = gevent.spawn(caller)
    while "thread started" not in events:
        gevent.sleep(0.005)
    g.kill(block=False)
    gevent.sleep(0.01)
    g.kill(block=False)  # a second interruption while it waits the thread out
    g.join()
    print(json.dumps({"events": events, "killed": isinstance(g.value, gevent.GreenletExit)}))
"""


def test_a_killed_caller_leaves_only_after_the_thread_is_done_with_its_descriptors() -> None:
    out = json.loads(clean_stdout(run_script(KILL_SCRIPT)))
    assert out["events"] == ["thread started", "thread done", "caller cleanup"]
    assert out["killed"]  # the kill still ends the caller
