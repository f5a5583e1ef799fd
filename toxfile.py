"""tox's inline plugin (tox loads ``toxfile.py`` beside tox.ini): find pyenv's interpreters.

pyenv puts only shims on PATH, and a shim answers only for the versions selected in
PYENV_VERSION / .python-version, so tox's own discovery skips py310/py312/py313 ("could not
find python interpreter") although pyenv has them. This hook adds every interpreter pyenv
installed to tox's ``--discover`` list (what tox tries first, by version match), so plain
``tox`` finds them; interpreters given with ``--discover`` keep their priority, and without
pyenv nothing changes. The pyenv plugins on PyPI (tox-pyenv-redux + virtualenv-pyenv) fail on
virtualenv >= 21 ("major version component is required"), hence these few lines.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tox.plugin import impl


def _pyenv_root() -> Path | None:
    if os.environ.get("PYENV_ROOT"):
        return Path(os.environ["PYENV_ROOT"])
    pyenv = shutil.which("pyenv")
    if pyenv is not None:
        found = subprocess.run([pyenv, "root"], capture_output=True, text=True, timeout=30, check=False)
        if found.returncode == 0 and found.stdout.strip():
            return Path(found.stdout.strip())
    default = Path.home() / ".pyenv"
    return default if default.is_dir() else None


def pyenv_interpreters() -> list[str]:
    """``<pyenv root>/versions/3.*/bin/python3`` for every CPython 3 pyenv installed (tox picks by version)."""
    root = _pyenv_root()
    if root is None:
        return []
    found = [p for p in (root / "versions").glob("3.*/bin/python3") if os.access(p, os.X_OK)]
    return [str(p) for p in sorted(found, reverse=True)]


@impl
def tox_add_core_config(core_conf, state) -> None:
    options = state.conf.options
    options.discover = [*(getattr(options, "discover", None) or []), *pyenv_interpreters()]
