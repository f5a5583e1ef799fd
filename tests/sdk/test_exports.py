"""The package root's public names resolve, and importing it stays cheap."""

import subprocess
import sys

import pytest

import shinken_sync


def test_every_exported_name_resolves():
    for name in shinken_sync.__all__:
        assert getattr(shinken_sync, name) is not None, name


def test_the_frame_budget_knob_is_not_re_exported():
    # it lives in shinken_sync.client only: a package-level copy would silently do nothing
    with pytest.raises(AttributeError):
        shinken_sync.GLOBAL_FRAME_BUDGET_BYTES  # noqa: B018


def test_import_is_lazy():
    code = "import sys, shinken_sync; print(sorted(m for m in ('websockets', 'shinken_sync.client') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
