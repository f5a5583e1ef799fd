"""Where the benches' session servers keep their data directories: a temporary directory.

A session server journals every session (docs/session-server-ops.md, *Sessions on disk*) in
``$XDG_STATE_HOME/shinken/session-server/HOST-PORT`` unless told otherwise; a bench starts
servers on port 0 again and again, so each would leave a directory behind in the home. Every
bench that starts one calls :func:`scratch_state_home` first: its servers inherit the variable.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def scratch_state_home() -> str:
    """Point ``XDG_STATE_HOME`` (for this process and its children) at a fresh temporary
    directory, removed when the bench exits; returns it."""
    path = tempfile.mkdtemp(prefix="shinken-bench-state-")
    os.environ["XDG_STATE_HOME"] = path
    atexit.register(shutil.rmtree, path, True)
    return path
