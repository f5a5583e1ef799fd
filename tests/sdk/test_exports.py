"""The package root's public names resolve, and importing it stays cheap."""

import subprocess
import sys

import shinken_sync


def test_every_exported_name_resolves():
    for name in shinken_sync.__all__:
        assert getattr(shinken_sync, name) is not None, name


def test_unknown_names_raise_attribute_error():
    try:
        shinken_sync.GLOBAL_FRAME_BUDGET_BYTES  # noqa: B018 (the knob lives in shinken_sync.client only)
    except AttributeError:
        pass
    else:
        raise AssertionError("the frame budget knob must not be re-exported")


def test_import_is_lazy():
    code = "import sys, shinken_sync; print(sorted(m for m in ('websockets', 'shinken_sync.client') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
