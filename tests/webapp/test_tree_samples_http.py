"""``POST /sessions/{id}/samples`` of tree sessions over HTTP, in both server modes, against the
reference backend with R3 on; and the samples hooks' settings at start-up.

The oracles are not our tree code: each leaf's sample is checked against the linear server's
sample of the same conversation replayed on a v1 session (the path through a tree is a linear
conversation; miles' ``build_leaf_material`` assembles it by the v1 rules), its R3 against the
reference backend's pure function of the leaf's tokens, its loss mask against miles' ownership
rule (the earliest picked leaf through a shared completion trains it), and the picked set
against miles' ``drop_retries`` rule, stated per case.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SHINKEN_")}
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "webapp.serve", "--bind", "127.0.0.1:0", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False, env=full)


@pytest.mark.parametrize(("args", "env", "words"), [
    (["--session-sample-picker-path", "keep_everything"], {}, ["session sample picker", "keep_everything"]),
    (["--session-sample-postprocessor-path", "tests.webapp.sample_hooks:missing"], {},
     ["session sample postprocessor", "has no 'missing'"]),
    (["--session-sample-picker-path", "tests.webapp.sample_hooks:async_picker"], {}, ["async"]),
    ([], {"SHINKEN_SESSION_SAMPLE_PICKER_PATH": "no_such_module_xyz:fn"}, ["cannot import"]),
    (["--session-sample-picker-path", "a b"], {}, ["--session-sample-picker-path", "must match"]),
])
def test_a_bad_hook_selector_is_one_line_and_exit_code_2(args, env, words):
    result = _serve(*args, env=env)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("usage:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(word in lines[0] for word in words), lines[0]
    assert result.stdout == ""  # nothing started
