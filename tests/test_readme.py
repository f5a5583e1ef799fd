"""The README's quick start is what CI runs, and it names every output the demo writes."""

from __future__ import annotations

import re
from pathlib import Path

from shinken_sync.demo import DEMO_OUTPUTS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def _quick_start_commands() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_the_quick_start_is_a_venv_then_the_main_job_then_the_tests():
    venv, main_job, tests = _quick_start_commands()[:3]
    assert venv.startswith("python3 -m venv ")  # pip refuses to install outside one on Debian 12
    # the SDK alone (`pip install -e .`) has no session server: the demo's extra brings it
    assert main_job == "pip install -e '.[demo]' && shinken demo"
    assert tests == "pip install tox && tox"


def test_ci_runs_the_readmes_test_command_and_its_main_job_in_a_fresh_venv():
    _, main_job, tests = _quick_start_commands()[:3]
    readme_install = main_job.split(" && ")[0].removeprefix("pip install ")
    ci_lines = [line.strip() for line in CI.splitlines()]
    assert tests in ci_lines
    assert re.search(r'python3 -m venv "\$scratch/venv"', CI)
    assert f'"$scratch/venv/bin/pip" install -q {readme_install}' in ci_lines  # the README's very install
    assert re.search(r'"\$scratch/venv/bin/shinken" demo ', CI)


def test_the_readme_lists_every_output_of_the_demo():
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    for name in DEMO_OUTPUTS:
        shown = f"`{name}/`" if "." not in name else f"`{name}`"
        assert shown in section, name
