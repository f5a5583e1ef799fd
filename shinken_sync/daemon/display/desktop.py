"""The real desktop on an Xvfb screen: a window manager and apps, declared once.

:data:`APPS` says, for each app an agent can open (``browser``, ``terminal``,
``editor``), which program runs, which Debian package provides it (the package
list both desktop forms are built from is ``images/desktop/packages.txt``), its
command line and the X window class its windows carry. :data:`DESKTOPS` says
what each ``shinkend --desktop NAME`` starts with the screen. Everything else
(the daemon's ``--desktop`` choices, the missing-program message and its
``apt-get`` line, the ``launch`` verb's app names, the docs' table) is derived
from these two tables.

:class:`DesktopSession` holds one running desktop's state: its private
directory (the apps' logs, the browser profile, XDG config/cache/runtime dirs,
so nothing is written to the account's home), the window manager process and
every app launched on it. :class:`~.xvfb.XvfbDisplay` owns it and calls it on
its X thread (every child must be forked there; see the xvfb module).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import IO, Any

from shinken_sync.protocol import ERR_BAD_ARGS, ERR_FAILED

from ..identity import AgentUser
from .base import DisplayError
from .procs import exit_status, signal_group

#: The window manager of every desktop, and its Debian package.
WINDOW_MANAGER = "openbox"
WINDOW_MANAGER_PACKAGE = "openbox"
#: Bytes of a program's log quoted in an error ("... exited with 1: <tail>").
LOG_TAIL_BYTES = 1500
#: Apps started by ``launch`` still running at once; one more is refused.
MAX_RUNNING_APPS = 32
#: How often the window manager may be restarted after it died, per desktop.
MAX_WM_RESTARTS = 5
#: An app opened with the desktop: its first window (Chromium's takes 1-2 s idle here).
LAUNCH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class LaunchContext:
    """What an app's command line may depend on."""

    width: int
    height: int
    #: The desktop's private directory (profiles live below it).
    home: str


@dataclass(frozen=True)
class App:
    """One app an agent can open on the desktop."""

    name: str
    #: The executable, looked up on PATH.
    program: str
    #: The Debian package providing :attr:`program` (listed in images/desktop/packages.txt).
    package: str
    #: The X window class of its top-level windows (``xdotool search --class``).
    window_class: str
    #: Its command line after the program (extra ``launch`` arguments follow).
    flags: Callable[[LaunchContext], list[str]]
    description: str
    #: Environment variables it gets on top of the desktop's.
    env: dict[str, str] = field(default_factory=dict)
    #: Its arguments when ``launch`` gives none.
    default_args: tuple[str, ...] = ()

    def argv(self, path: str, context: LaunchContext, extra: Sequence[str] = ()) -> list[str]:
        return [path, *self.flags(context), *(extra or self.default_args)]


def _chromium_flags(ctx: LaunchContext) -> list[str]:
    return [
        # Chromium's own sandbox needs root-free user namespaces or a setuid helper; the
        # sandbox around this desktop (the isolated provider) is the boundary instead.
        "--no-sandbox",
        "--test-type",  # no "unsupported command-line flag" infobar over the page
        "--disable-gpu",
        "--disable-dev-shm-usage",  # a sandbox's /dev/shm may be tiny
        # Without these Chromium keeps dialling Google's services, refused by a closed network.
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-quic",
        "--disable-breakpad",
        "--disable-features=Translate,MediaRouter,OptimizationHints",
        "--no-first-run",
        "--no-default-browser-check",
        "--password-store=basic",  # no keyring daemon to ask
        f"--user-data-dir={os.path.join(ctx.home, 'browser-profile')}",
        "--window-position=0,0",
        f"--window-size={ctx.width},{ctx.height}",
        # A launch while the browser runs hands its URLs to the running one: in a window
        # of its own (not a tab), which launch waits for and focuses.
        "--new-window",
    ]


def _xterm_flags(ctx: LaunchContext) -> list[str]:
    # An Xft font draws any Unicode DejaVu/Droid cover; metaSendsEscape makes alt+b a
    # readline word jump instead of a Latin-1 character. The shell skips rc files: the
    # desktop's terminal behaves the same on every host (an account's rc may block).
    return ["-fa", "Monospace", "-fs", "11", "-xrm", "XTerm*metaSendsEscape: true",
            "-e", "bash", "--noprofile", "--norc"]  # fmt: skip


#: name -> App: every app ``launch`` can open.
APPS: dict[str, App] = {
    app.name: app
    for app in (
        App("browser", "chromium", "chromium", "Chromium", _chromium_flags,
            "Chromium; extra arguments are URLs to open", default_args=("about:blank",)),
        App("terminal", "xterm", "xterm", "XTerm", _xterm_flags,
            "xterm running bash (no rc files)", env={"PS1": r"\u@sandbox:\w\$ "}),
        App("editor", "mousepad", "mousepad", "Mousepad", lambda ctx: ["--disable-server"],
            "Mousepad (GTK text editor); extra arguments are files to open"),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Desktop:
    """What ``shinkend --desktop NAME`` starts with the screen."""

    name: str
    #: Apps opened at start, in order; the last one ends up on top with the focus.
    start: tuple[str, ...]
    description: str

    @property
    def programs(self) -> dict[str, str]:
        """program -> Debian package, for everything this desktop may run: its window
        manager and every app ``launch`` can open."""
        return {WINDOW_MANAGER: WINDOW_MANAGER_PACKAGE, **{APPS[a].program: APPS[a].package for a in APPS}}


DESKTOPS: dict[str, Desktop] = {
    d.name: d
    for d in (
        Desktop("full", ("terminal", "editor", "browser"),
                "openbox with a terminal, the editor and Chromium open (Chromium in front)"),
        Desktop("browser", ("browser",), "openbox with Chromium open; the terminal and the editor come with launch"),
        Desktop("wm", (), "openbox and no app open; apps come with launch"),
    )
}  # fmt: skip


def log_tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - LOG_TAIL_BYTES))
            text = f.read().decode(errors="replace").strip()
    except OSError:
        return ""
    return text


@dataclass(eq=False)
class Running:
    """One app started on the desktop."""

    app: str
    proc: subprocess.Popen[bytes]
    log_path: str
    #: The X window it opened (None until it showed one).
    window: str | None = None
    #: A launch is waiting for its window: reap() leaves it to that launch.
    pending: bool = True


Spawner = Callable[..., subprocess.Popen[bytes]]
#: Waits for an exited child and drops it from the display's children.
Forgetter = Callable[[subprocess.Popen[bytes]], None]


class DesktopSession:
    """One desktop's directory, window manager and apps (see the module docstring).

    Not thread-safe: every method runs on the owning display's X thread.
    """

    def __init__(self, desktop: Desktop, display_name: str, width: int, height: int, spawn: Spawner,
                 forget: Forgetter, agent: AgentUser | None = None):
        self.desktop = desktop
        self._spawn = spawn
        self._forget = forget
        #: In an isolated sandbox the apps run as the agent (daemon/identity.py), like exec's
        #: commands: a shell in the terminal must not hold the daemon's uid and capabilities.
        self.agent = agent
        self.home = tempfile.mkdtemp(prefix=f"shinken-desktop-{desktop.name}-")
        os.chmod(self.home, 0o700)
        dirs = {name: os.path.join(self.home, name) for name in ("config", "cache", "run")}
        for path in dirs.values():
            os.mkdir(path, 0o700)
        if agent is not None:  # the apps write their profiles and caches below it
            for path in (self.home, *dirs.values()):
                os.chown(path, agent.uid, agent.gid)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DBUS_")}
        if agent is not None:
            env.update(agent.environment())
        # GTK apps talk to dconf through D-Bus; there is no session bus here.
        self.env = {**env, "DISPLAY": display_name, "XDG_CONFIG_HOME": dirs["config"],
                    "XDG_CACHE_HOME": dirs["cache"], "XDG_RUNTIME_DIR": dirs["run"],
                    "GSETTINGS_BACKEND": "memory", "NO_AT_BRIDGE": "1"}  # fmt: skip
        self.context = LaunchContext(width, height, self.home)
        self.wm: subprocess.Popen[bytes] | None = None
        self.wm_restarts = 0
        self.apps: list[Running] = []
        self._paths = {program: shutil.which(program) for program in desktop.programs}

    def log_path(self, name: str) -> str:
        return os.path.join(self.home, f"{name}.log")

    def _open_log(self, name: str) -> IO[bytes]:
        return open(self.log_path(name), "ab")

    def start_window_manager(self) -> None:
        path = self._paths[WINDOW_MANAGER]
        if path is None:
            raise DisplayError(f"{WINDOW_MANAGER} is not on PATH", ERR_FAILED)
        config = resources.files(__package__).joinpath("openbox-rc.xml")
        with resources.as_file(config) as rc, self._open_log(WINDOW_MANAGER) as log:
            self.wm = self._spawn([path, "--config-file", str(rc)], env=self.env, stdout=log, stderr=log)

    def wm_failure(self) -> str | None:
        """Why the window manager is not running (with its log tail), or None while it runs."""
        status = None if self.wm is None else exit_status(self.wm)
        if status is None:
            return None
        return f"{WINDOW_MANAGER} exited ({status}): {log_tail(self.log_path(WINDOW_MANAGER))}"

    def restart_window_manager(self) -> bool:
        """Start the window manager again after it died; False once the restarts are used up."""
        if self.wm_restarts >= MAX_WM_RESTARTS:
            return False
        self.wm_restarts += 1
        if self.wm is not None:
            self._bury(self.wm)
        self.start_window_manager()
        return True

    def _bury(self, proc: subprocess.Popen[bytes]) -> None:
        signal_group(proc, signal.SIGKILL)  # stragglers of the group, before its id is freed
        self._forget(proc)

    def spawn_app(self, name: str, extra: Sequence[str] = ()) -> Running:
        """Start app ``name``; its output goes to ``<name>.log`` in the desktop's directory."""
        app = APPS.get(name)
        if app is None:
            raise DisplayError(f"unknown app {name!r}; the desktop has {', '.join(APPS)}", ERR_BAD_ARGS)
        self.reap()
        if len(self.apps) >= MAX_RUNNING_APPS:
            raise DisplayError(f"{len(self.apps)} apps are running already; close one first", ERR_FAILED)
        path = self._paths.get(app.program)
        if path is None:
            raise DisplayError(f"{app.program} is not on PATH (apt-get install {app.package})", ERR_FAILED)
        argv = app.argv(path, self.context, extra)
        options: dict[str, Any] = {}
        if self.agent is not None:
            argv = self.agent.argv(argv)
            options = {**self.agent.popen_options(), "cwd": self.agent.home}
        with self._open_log(name) as log:
            try:
                proc = self._spawn(argv, env={**self.env, **app.env}, stdout=log, stderr=log, **options)
            except OSError as exc:
                raise DisplayError(f"cannot start {app.program}: {exc}", ERR_FAILED) from None
        running = Running(name, proc, self.log_path(name))
        self.apps.append(running)
        return running

    def app_failure(self, running: Running) -> str | None:
        """Why ``running`` ended badly before showing a window (with its log tail), or None.

        Exit status 0 is not a failure: a second browser hands its URL to the
        first one and exits, and the window then comes from that one.
        """
        status = exit_status(running.proc)
        if status in (None, "exit 0", "exited"):  # "exited": reaped, status unknown: keep waiting
            return None
        return f"{APPS[running.app].program} exited ({status}) before showing a window: {log_tail(running.log_path)}"

    def reap(self) -> None:
        """Forget apps that exited (closed by the agent, alt+F4): their stragglers are killed."""
        alive = []
        for running in self.apps:
            if running.pending or exit_status(running.proc) is None:
                alive.append(running)
            else:
                self._bury(running.proc)
        self.apps = alive

    def status(self) -> dict[str, Any]:
        return {
            "name": self.desktop.name,
            "window_manager": WINDOW_MANAGER,
            "home": self.home,
            "apps": [{"app": r.app, "pid": r.proc.pid, "window": None if r.window is None else int(r.window)}
                     for r in self.apps
                     if exit_status(r.proc) is None],
        }  # fmt: skip

    def remove(self) -> None:
        """Delete the desktop's directory (after its processes stopped)."""
        shutil.rmtree(self.home, ignore_errors=True)


def missing_programs(desktop: Desktop) -> dict[str, str]:
    """program -> package for what ``desktop`` runs and PATH lacks."""
    return {prog: pkg for prog, pkg in desktop.programs.items() if shutil.which(prog) is None}
