"""bench/miles_side_by_side.py without the network: its arguments, its stand-ins, its ratios.

The stand-ins must let miles' session modules import and must fail loudly when called (a
bench that silently called a fake would measure nothing). The last test imports miles'
session-server modules through the stand-ins for real; it needs a miles git directory
(``SHINKEN_MILES_MIRROR``) and the harness's scratch venv (built by a first run of the bench),
and is skipped without them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench imports its siblings (procfs, rawhttp) as top-level modules

import miles_launch
import miles_side_by_side as sbs


def test_defaults_are_the_issue_shape():
    args = sbs.parse_args([])
    assert (args.clients, args.chats, args.records_mib, args.ours_old) == (64, 100, 250.0, "37e6388")
    assert args.only.split(",") == list(sbs.DEFAULT_SERVERS) == [s for s in sbs.ALL_SERVERS if s != "base-w0"]
    assert args.miles_repo.startswith("https://github.com/radixark/miles")


@pytest.mark.parametrize("argv", [["--only", "ours-w0,nginx"], ["--clients", "0"], ["--turns", "0"], ["--rounds", "0"],
                                  ["--only", "ours-w0,base-w0"]])  # base-w0 without --ours-base
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as exc:
        sbs.parse_args(argv)
    assert exc.value.code == 2


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, str(BENCH / "miles_side_by_side.py"), "--help"], capture_output=True,
                         text=True, check=True, env=dict(os.environ, PYTHONPATH=str(BENCH.parent))).stdout
    for flag in ("--miles-repo", "--miles-tree", "--miles-pr-tree", "--miles-pr-ref", "--ours-old", "--ours-base", "--clients",
                 "--chats", "--turns", "--records-mib", "--scratch", "--only"):
        assert flag in out
    assert "--load-worker" not in out


def test_standins_import_subclass_decorate_but_refuse_a_call():
    name = "shinken_standin_probe"
    miles_launch.install_standins((name,))
    try:
        import shinken_standin_probe as probe  # type: ignore[import-not-found]  # the stand-in
        from shinken_standin_probe.nn import functional  # type: ignore[import-not-found]

        class Model(probe.nn.Module):  # a base class that is a stand-in
            pass

        @probe.no_grad()
        def f(x: int) -> int:
            return x + 1

        assert f(1) == 2 and isinstance(Model(), object) and functional.relu is not None
        with pytest.raises(miles_launch.StandinCalled, match="shinken_standin_probe.zeros"):
            probe.zeros(3)
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, miles_launch._StandinFinder)]
        for mod in [m for m in sys.modules if m.split(".")[0] == name]:
            del sys.modules[mod]


def test_ratios_against_the_targets():
    def res(name: str, cps: float, p50: float, p99: float, cpu: float) -> sbs.Result:
        return sbs.Result(name, name, 100, 1.0, cps, p50, p99, cpu)

    results = {r.server: r for r in (res("ours-w0", 300, 10, 20, 1.0), res("miles-main", 100, 20, 200, 5.0),
                                     res("ours-w2", 150, 30, 40, 2.0), res("miles-pr-w2", 100, 20, 90, 3.0),
                                     res("old-w0", 100, 10, 20, 1.05), res("base-w0", 100, 10, 20, 1.25))}
    checks = {name: (value, verdict) for name, value, _, verdict in sbs.report(results)}
    assert checks["chats/s ours-w0 / miles-main"] == (3.0, "met")
    assert checks["p99 ours-w0 / miles-main"] == (0.1, "met")
    assert checks["chats/s ours-w2 / miles-pr-w2"] == (1.5, "NOT met")
    assert checks["p50 ours-w2 / miles-pr-w2"] == (1.5, "NOT met")
    assert checks["CPU/chat ours-w0 / old-w0"][1] == "NOT met"
    assert checks["CPU/chat ours-w0 / base-w0"] == (0.8, "n/a")  # a second old tree: reported, no target
    assert sbs.report({})[0][1:] == (None, ">= 3", "n/a")


def test_miles_session_modules_import_through_the_standins(tmp_path):
    mirror = os.environ.get("SHINKEN_MILES_MIRROR")
    python = sbs.default_scratch() / "venv" / "bin" / "python"
    if not mirror or not Path(mirror).exists():
        pytest.skip("SHINKEN_MILES_MIRROR (a miles git directory) is not set or absent")
    if not python.exists():
        pytest.skip(f"no scratch venv at {python}: run bench/miles_side_by_side.py once")
    for commit, workers in (("HEAD", 0), (sbs.MILES_PR_COMMIT, 2)):
        tree = sbs.extract(Path(mirror), commit, tmp_path / commit)
        out = subprocess.run([str(python), str(BENCH / "miles_launch.py"), "--miles-tree", str(tree), "--tokenizer",
                              "unused", "--backend", "unused", "--port", "1", "--workers", str(workers),
                              "--check-imports"], check=False, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "imports ok" in out.stdout, out.stderr[-2000:]
