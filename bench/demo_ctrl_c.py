"""How fast ``shinken demo`` answers and stops on Ctrl-C (docs/demo.md, docs/benchmarks.md).

Starts ``shinken demo --sandboxes N --turns 500`` in its own session, waits until it has taken
a step and ``--after`` seconds more, then sends SIGINT to its group as a terminal does; with
``--second`` another one 0.3 s later. Prints the time to the demo's first feedback line, to its
exit, and the exit code, per repeat::

    python bench/demo_ctrl_c.py --sandboxes 8 --repeats 3 [--second]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

from shinken_sync.stats import percentile
from tests.support import start_process


def _wait(log: Path, pattern: str, timeout: float) -> float:
    start, deadline = time.monotonic(), time.monotonic() + timeout
    while not re.search(pattern, log.read_text()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {pattern!r} after {timeout} s: {log.read_text()[-1500:]}")
        time.sleep(0.01)
    return time.monotonic() - start


def once(sandboxes: int, after: float, second: bool, work: Path) -> tuple[float, float, int]:
    log = work / "demo.log"
    with open(log, "w") as sink:
        proc = start_process([sys.executable, "-m", "shinken_sync.cli", "demo", "--sandboxes", str(sandboxes),
                              "--turns", "500", "--out", str(work / "out")],
                             stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(log, r"\| *[1-9]\d*/\d+ \[", 120)
        time.sleep(after)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        feedback = _wait(log, "shinken demo: interrupted", 30)
        if second:
            time.sleep(0.3)
            os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(120)
        return feedback, time.monotonic() - t0, code
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sandboxes", type=int, default=8)
    parser.add_argument("--after", type=float, default=2.0, help="seconds of rollout before the Ctrl-C")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--second", action="store_true", help="a second Ctrl-C 0.3 s after the first")
    args = parser.parse_args()
    feedbacks, exits = [], []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as work:
            feedback, exit_s, code = once(args.sandboxes, args.after, args.second, Path(work))
        feedbacks.append(feedback)
        exits.append(exit_s)
        print(f"run {i}: feedback {feedback:.2f} s, exit {exit_s:.2f} s after the first Ctrl-C, code {code}")
    print(f"{args.sandboxes} sandboxes, {'two Ctrl-Cs' if args.second else 'one Ctrl-C'}: feedback p50 "
          f"{percentile(feedbacks, 50):.2f} s, exit p50 {percentile(exits, 50):.2f} s, max {max(exits):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
