"""Bulk work goes last in its process (``webapp.bulk``): large requests' CPU sections run one at
a time, a request leaves its section while it waits on its engine and takes it again after, and
a section that never ends costs the others a bounded wait. In a fresh gevent-patched interpreter, as a session worker runs."""

from __future__ import annotations

import json

from tests.support import clean_stdout, run_script

SCRIPT = """
    from gevent import monkey
    monkey.patch_all()
    import json, time
    import gevent
    from webapp import bulk

    events = []

    def section(name, work, early_end=False):
        with bulk.bulk_lane():
            events.append(("in", name))
            with bulk.bulk_lane():  # re-entrant: the image work inside the turn's section
                end = time.monotonic() + work
                while time.monotonic() < end:  # CPU work: the hub does not switch meanwhile
                    pass
            if early_end:
                with bulk.bulk_io():  # the engine send and its answer: the lane left meanwhile
                    events.append(("sent", name))
                    gevent.sleep(bulk.LANE_MAX_WAIT / 2)  # (shorter: D would still wait for C otherwise)
                events.append(("back", name))  # the lane taken again for the answer's work
            events.append(("out", name))

    def small():
        events.append(("small", None))

    # A and B want the lane at once; a small request becomes ready while A holds it.
    jobs = [gevent.spawn(section, "A", 0.02), gevent.spawn(section, "B", 0.02)]
    gevent.sleep(0)
    gevent.spawn(small)
    gevent.joinall(jobs)
    order = [e for e in events]

    # C ends its section at its engine send; D gets the lane while C waits for its answer.
    events.clear()
    jobs = [gevent.spawn(section, "C", 0.01, True), gevent.spawn(section, "D", 0.01)]
    gevent.joinall(jobs)
    early = list(events)

    # E holds the lane and never lets go in time; F waits at most LANE_MAX_WAIT.
    def hog():
        with bulk.bulk_lane():
            gevent.sleep(1.0)
    hogs = gevent.spawn(hog)
    gevent.sleep(0.01)
    start = time.monotonic()
    with bulk.bulk_lane():
        waited = time.monotonic() - start
    hogs.kill()
    print(json.dumps({"order": order, "early": early, "waited": waited, "max_wait": bulk.LANE_MAX_WAIT}))
"""


def test_sections_run_one_at_a_time_leave_the_lane_for_io_and_never_wait_long() -> None:
    result = run_script(SCRIPT)
    assert result.returncode == 0, result.stderr
    got = json.loads(clean_stdout(result).splitlines()[-1])
    order = [tuple(e) for e in got["order"]]
    # A's section whole, then B's: never interleaved (B waited for the lane off the run queue)
    assert order.index(("out", "A")) < order.index(("in", "B"))
    # the small request ran before B's section, though B was ready first
    assert order.index(("small", None)) < order.index(("in", "B"))
    early = [tuple(e) for e in got["early"]]
    # D ran its whole section while C waited for its engine, not after C's whole request
    assert early.index(("in", "C")) < early.index(("in", "D")) < early.index(("out", "D")) < early.index(("back", "C"))
    # a section that never ends holds the others for LANE_MAX_WAIT, not for its length
    assert got["max_wait"] * 0.5 <= got["waited"] < 0.5
