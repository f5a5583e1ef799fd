"""toxfile.py: tox finds every interpreter pyenv installed, not only the versions its shims
answer for (``tox`` skipped py310/py312/py313 with "could not find python interpreter")."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("tox")  # the hook module imports tox; tox's own environments do not have it


def _toxfile():
    spec = importlib.util.spec_from_file_location("toxfile", Path(__file__).parent.parent / "toxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tox_is_pointed_at_every_pyenv_interpreter(tmp_path, monkeypatch):
    for version in ("3.10.13", "3.12.1", "3.13.0", "2.7.18"):
        exe = tmp_path / "versions" / version / "bin" / ("python3" if version[0] == "3" else "python2")
        exe.parent.mkdir(parents=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    toxfile = _toxfile()
    found = toxfile.pyenv_interpreters()
    assert found == [str(tmp_path / "versions" / v / "bin" / "python3") for v in ("3.13.0", "3.12.1", "3.10.13")]
    options = SimpleNamespace(discover=["/opt/python3.11/bin/python3"])  # a user's --discover comes first
    toxfile.tox_add_core_config(None, SimpleNamespace(conf=SimpleNamespace(options=options)))
    assert options.discover == ["/opt/python3.11/bin/python3", *found]


def test_without_pyenv_nothing_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "absent"))
    options = SimpleNamespace(discover=[])
    _toxfile().tox_add_core_config(None, SimpleNamespace(conf=SimpleNamespace(options=options)))
    assert options.discover == []
