"""A real X screen: its own Xvfb, input through xdotool, capture through mss (MIT-SHM).

Everything blocking (spawning, xdotool, capture, encode) runs on ONE thread
owned by the display, so the event loop never waits on X and the X client
(mss's connection) is only ever used from one thread. That thread also forks
every child: ``PR_SET_PDEATHSIG`` fires when the forking *thread* exits, and
this one lives exactly as long as the display.

With ``desktop=NAME`` the screen is a real desktop (:mod:`.desktop`): openbox
and the desktop's apps start with it, the window manager is restarted if it
dies, and :meth:`XvfbDisplay.launch` opens more apps. Screenshots include the
mouse pointer (XFixes' cursor image, composited by mss) unless
``draw_pointer=False``.

Children (Xvfb, the optional window manager, the optional ``launch`` program)
each start in their own session under ``setpriv --pdeathsig KILL``, so a
SIGKILLed daemon takes them with it; :meth:`XvfbDisplay.close` stops their
process groups (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`).

Screenshots keep the previous frame per geometry (scaled image and its banded
JPEG/PNG encodings) and redo only what changed: rescale the changed areas,
re-encode the 16-row bands they touch (see :mod:`shinken_sync.daemon.imaging`). The change token
is a generation counter bumped whenever a capture differs from the previous one
(a memcmp, cheaper here than a crc32 of the 8 MB buffer).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from PIL import Image

from shinken_sync.protocol import ERR_BAD_ARGS, ERR_FAILED, ERR_TIMEOUT, ERR_UNSUPPORTED
from shinken_sync.verbs import DEFAULT_IMAGE_FORMAT, DEFAULT_IMAGE_QUALITY

from .. import identity, imaging
from . import desktop as desktops
from .base import Display, DisplayError, EncodedImage
from .errors import DisplayUnavailable
from .keys import parse_combo
from .procs import exit_status, signal_group
from .xkeymap import REBIND_SETTLE_S, SpareKeycodes

try:  # the [xvfb] extra; make_display reports it missing as DisplayUnavailable
    import mss
    import mss.exception
except ImportError:  # pragma: no cover - depends on the installation
    # None says "missing" (make_display checks it); unused-ignore: where mss is not installed
    # (the lint env) its name is Any and None fits.
    mss = None  # type: ignore[assignment, unused-ignore]

log = logging.getLogger(__name__)
_SETPRIV = shutil.which("setpriv")
T = TypeVar("T")

MIN_SIZE = (64, 64)
MAX_SIZE = (7680, 4320)
#: Xvfb start: exec until it reports its display number on -displayfd.
START_TIMEOUT_S = 10.0
#: A launched program's first visible window.
LAUNCH_TIMEOUT_S = 10.0
#: SIGTERM -> SIGKILL escalation when stopping children.
STOP_TIMEOUT_S = 3.0
#: One xdotool invocation; typing adds TYPE_DELAY_MS per character.
XDOTOOL_TIMEOUT_S = 10.0
#: Between typed characters (xdotool's default is 12). The characters xdotool
#: lost at short delays were those it typed through its scratch keycode; with
#: them pre-bound (xkeymap), 3 ms delivered every character in every run.
TYPE_DELAY_MS = 3
#: Pointer motion events a drag sends between press and release, so toolkits
#: that track motion (sliders, window moves) see a path, not a jump.
DRAG_STEPS = 8
#: Frames kept for incremental updates (one per screenshot geometry; each also
#: pins one raw capture, 8 MB at 1080p).
FRAMES_KEPT = 2
#: Encodings kept per frame (e.g. an agent's PNG beside a screencast's JPEG).
ENCODINGS_KEPT = 2
#: Changed rectangles an encoding tracks before it is simply redone.
MAX_STALE_RECTS = 256
#: Above this fraction of changed pixels a full resize beats patching.
FULL_RESCALE_FRACTION = 0.5
#: How often a desktop's window manager is checked (and restarted if it died).
SUPERVISE_INTERVAL_S = 1.0
#: Between looks for an app's window.
WINDOW_POLL_S = 0.05

#: Tried in order when ``window_manager=True``; the first one installed runs.
WINDOW_MANAGERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("matchbox-window-manager", ("-use_titlebar", "no")),
    ("openbox", ()),
    ("fluxbox", ()),
    ("icewm", ()),
    ("twm", ()),
)
_BUTTONS = {"left": "1", "middle": "2", "right": "3"}


#: program -> the Debian package that provides it (for the install hint).
APT_PACKAGES = {"Xvfb": "xvfb", "xdotool": "xdotool", "xterm": "xterm"}
REQUIRED_PROGRAMS = ("Xvfb", "xdotool")


def missing_prerequisites(programs: Sequence[str] = REQUIRED_PROGRAMS, desktop: str | None = None) -> str | None:
    """Everything the xvfb display (and ``programs``, and the programs of ``desktop``) lacks
    here, in one message with every fix; None when nothing is missing."""
    packages = dict(APT_PACKAGES)
    wanted = list(programs)
    if desktop is not None:
        packages.update(desktops.DESKTOPS[desktop].programs)
        wanted += [p for p in desktops.DESKTOPS[desktop].programs if p not in wanted]
    missing = [name for name in wanted if shutil.which(name) is None]
    needs, fixes = [], []
    if missing:
        needs.append(f"{' and '.join(missing)} on PATH")
        fixes.append("apt-get install " + " ".join(dict.fromkeys(packages.get(name, name) for name in missing)))
    if mss is None:
        needs.append("the mss package")
        fixes.append("pip install 'shinken[xvfb]'")
    if not needs:
        return None
    what = "the xvfb display" if desktop is None else f"the {desktop} desktop"
    return f"{what} needs {' and '.join(needs)}: {'; '.join(fixes)}"


def _require_programs(desktop: str | None = None) -> dict[str, str]:
    problem = missing_prerequisites(desktop=desktop)
    if problem is not None:
        raise DisplayUnavailable(problem)
    if _SETPRIV is None:
        log.warning("setpriv (util-linux) not found: Xvfb will outlive a SIGKILLed daemon")
    return {name: shutil.which(name) for name in REQUIRED_PROGRAMS}  # type: ignore[misc]


class XvfbDisplay(Display):
    """A private Xvfb screen; see the module docstring."""

    kind = "xvfb"

    def __init__(
        self,
        width: int,
        height: int,
        *,
        window_manager: bool = True,
        launch: Sequence[str] | None = None,
        depth: int = 24,
        start_timeout: float = START_TIMEOUT_S,
        desktop: str | None = None,
        draw_pointer: bool = True,
    ):
        if not (MIN_SIZE[0] <= width <= MAX_SIZE[0] and MIN_SIZE[1] <= height <= MAX_SIZE[1]):
            raise ValueError(
                f"xvfb size {width}x{height} outside {MIN_SIZE[0]}x{MIN_SIZE[1]}..{MAX_SIZE[0]}x{MAX_SIZE[1]}"
            )
        if depth not in (24, 32):  # mss reads 4-byte pixels
            raise ValueError("xvfb depth must be 24 or 32")
        if desktop is not None and desktop not in desktops.DESKTOPS:
            raise ValueError(f"unknown desktop {desktop!r}; expected one of {', '.join(desktops.DESKTOPS)}")
        self._programs = _require_programs(desktop)
        self.width, self.height, self.depth = width, height, depth
        #: The desktop started with the screen (None: a bare screen, see window_manager).
        self.desktop = desktop
        #: Screenshots show the mouse pointer.
        self.draws_pointer = draw_pointer
        self._session: desktops.DesktopSession | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self.window_manager = window_manager
        #: The program started on the screen at start (the ``launch`` option).
        self.launch_argv = list(launch) if launch else None
        self.start_timeout = start_timeout
        #: ":N" once started.
        self.display_name: str | None = None
        #: The window manager that runs, if any.
        self.window_manager_name: str | None = None
        self._env: dict[str, str] = {}
        self._children: list[subprocess.Popen[bytes]] = []
        self._x = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xvfb")
        self._start_lock = asyncio.Lock()
        self._started = False
        self._closed = False
        self._sct: Any = None
        self._keymap: SpareKeycodes | None = None
        self._last_raw: bytearray | None = None
        self._generation = 0
        self._frames: collections.OrderedDict[imaging.Geometry, _Frame] = collections.OrderedDict()

    @property
    def pids(self) -> list[int]:
        """Process ids of every child this display started (Xvfb first)."""
        return [p.pid for p in self._children]

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if not self._started or self._closed:
            raise DisplayError("the xvfb display is not running", ERR_FAILED)
        return await asyncio.get_running_loop().run_in_executor(self._x, self._guarded, fn, *args)

    def _guarded(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the X thread; a dead Xvfb or a failed capture is a DisplayError."""
        status = exit_status(self._children[0])
        if status is not None:
            raise DisplayError(f"Xvfb {self.display_name} exited ({status})", ERR_FAILED)
        try:
            return fn(*args)
        except mss.exception.ScreenShotError as exc:
            raise DisplayError(f"capture of {self.display_name} failed: {exc}", ERR_FAILED) from None

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        async with self._start_lock:
            if self._started:
                return
            if self._closed:
                raise DisplayError("the xvfb display was closed", ERR_FAILED)
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._x, self._start_sync)
                self._started = True
                if self.desktop is not None:
                    await self._start_desktop(self.desktop)
                if self.launch_argv:
                    await self._run(self._launch_sync, self.launch_argv)
            except BaseException:
                self._started = False
                await loop.run_in_executor(self._x, self._stop_sync)
                raise
            if self._session is not None:
                self._supervisor = asyncio.create_task(self._supervise(self._session))
            log.info("xvfb %s up (%dx%d, wm=%s, desktop=%s)", self.display_name, self.width, self.height,
                     self.window_manager_name, self.desktop)

    def _spawn(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        # setpriv (util-linux) sets PR_SET_PDEATHSIG between fork and exec without a
        # preexec_fn, which is unsafe in a threaded process.
        prefix = [_SETPRIV, "--pdeathsig", "KILL", "--"] if _SETPRIV else []
        kwargs.setdefault("stdout", subprocess.DEVNULL)
        kwargs.setdefault("stderr", subprocess.DEVNULL)
        proc = subprocess.Popen(
            [*prefix, *argv], stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True, **kwargs
        )
        self._children.append(proc)
        return proc

    def _forget(self, proc: subprocess.Popen[bytes]) -> None:
        """Reap an exited child and stop tracking it (its group was killed already)."""
        proc.wait()
        self._children.remove(proc)

    def _start_sync(self) -> None:
        read_fd, write_fd = os.pipe()
        stderr = tempfile.TemporaryFile(prefix="shinken-xvfb-")  # noqa: SIM115 (read on failure)
        try:
            xvfb = self._spawn(
                [self._programs["Xvfb"], "-displayfd", str(write_fd), "-screen", "0",
                 f"{self.width}x{self.height}x{self.depth}", "-nolisten", "tcp", "-noreset"],
                pass_fds=(write_fd,),
                stderr=stderr,
            )
            os.close(write_fd)
            write_fd = -1
            number = self._read_display_number(read_fd, xvfb, stderr)
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
            stderr.close()
        self.display_name = f":{number}"
        self._env = {**os.environ, "DISPLAY": self.display_name}
        self._sct = mss.MSS(display=self.display_name, with_cursor=self.draws_pointer)
        self._keymap = SpareKeycodes(self.display_name)
        if self.window_manager and self.desktop is None:  # a desktop brings its own
            self._start_window_manager()

    def _read_display_number(self, fd: int, xvfb: subprocess.Popen[bytes], stderr: Any) -> int:
        deadline = time.monotonic() + self.start_timeout
        data = b""
        while not data.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DisplayError(f"Xvfb did not report a display within {self.start_timeout:.0f} s", ERR_TIMEOUT)
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.1))
            if ready:
                chunk = os.read(fd, 64)
                if chunk:
                    data += chunk
                    continue
            if xvfb.poll() is not None:
                stderr.seek(0)
                tail = stderr.read()[-2000:].decode(errors="replace").strip()
                raise DisplayError(f"Xvfb exited with {xvfb.returncode} before it was ready: {tail}", ERR_FAILED)
        return int(data)

    def _start_window_manager(self) -> None:
        for name, args in WINDOW_MANAGERS:
            path = shutil.which(name)
            if path is not None:
                self._spawn([path, *args], env=self._env)
                self.window_manager_name = name
                if name != "twm":  # the others announce themselves (EWMH); twm does not
                    # A window mapped while the manager is still starting up may stay
                    # unmapped (seen with openbox and xterm): launch only once it manages.
                    deadline = time.monotonic() + self.start_timeout
                    while not self._wm_ready() and time.monotonic() < deadline:
                        time.sleep(0.02)
                return
        log.info("no window manager installed (tried %s); running without one",
                 ", ".join(n for n, _ in WINDOW_MANAGERS))

    def _launch_sync(self, argv: list[str]) -> None:
        """Start ``argv`` on this screen and give keyboard focus to its first window."""
        try:
            proc = self._spawn(argv, env=self._env)
        except OSError as exc:
            raise DisplayError(f"cannot launch {argv[0]!r}: {exc}", ERR_FAILED) from None
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise DisplayError(f"{argv[0]!r} exited with {proc.returncode} before showing a window", ERR_FAILED)
            found = subprocess.run(
                [self._programs["xdotool"], "search", "--onlyvisible", "--pid", str(proc.pid)],
                env=self._env, capture_output=True, timeout=XDOTOOL_TIMEOUT_S, check=False,
            )
            windows = found.stdout.split()
            if windows:
                # Without a window manager nobody hands out focus; X would send
                # keys to whatever lies under the pointer.
                self._xdotool("windowfocus", windows[0].decode())
                return
            time.sleep(0.05)
        raise DisplayError(f"{argv[0]!r} showed no window within {LAUNCH_TIMEOUT_S:.0f} s", ERR_TIMEOUT)

    # -- the desktop -------------------------------------------------------------

    @property
    def desktop_status(self) -> dict[str, Any] | None:
        """The desktop's name, window manager, directory and running apps (None: no desktop)."""
        return None if self._session is None else self._session.status()

    async def _start_desktop(self, name: str) -> None:
        assert self.display_name is not None
        session = desktops.DesktopSession(desktops.DESKTOPS[name], self.display_name, self.width, self.height,
                                          self._spawn, self._forget, identity.agent())  # fmt: skip
        self._session = session
        deadline = asyncio.get_running_loop().time() + self.start_timeout
        await self._run(session.start_window_manager)
        self.window_manager_name = desktops.WINDOW_MANAGER
        while not await self._run(self._wm_ready):
            failure = session.wm_failure()
            if failure is not None:
                raise DisplayError(f"the {name} desktop did not start: {failure}", ERR_FAILED)
            if asyncio.get_running_loop().time() >= deadline:
                raise DisplayError(f"{desktops.WINDOW_MANAGER} did not manage {self.display_name} within "
                                   f"{self.start_timeout:.0f} s", ERR_TIMEOUT)  # fmt: skip
            await asyncio.sleep(WINDOW_POLL_S)
        # The apps boot in parallel (Chromium's first window is most of the start).
        opened = [await self._run(session.spawn_app, app) for app in session.desktop.start]
        windows = await asyncio.gather(
            *(self._await_window(running, set(), desktops.LAUNCH_TIMEOUT_S) for running in opened)
        )
        for window in windows:  # in order: the last one ends up on top, with the focus
            await self._run(self._xdotool, "windowactivate", window)

    def _wm_ready(self) -> bool:
        # openbox sets _NET_NUMBER_OF_DESKTOPS on the root window once it manages the screen.
        done = subprocess.run([self._programs["xdotool"], "get_num_desktops"], env=self._env,
                              capture_output=True, timeout=XDOTOOL_TIMEOUT_S, check=False)  # fmt: skip
        return done.returncode == 0

    def _windows_of(self, window_class: str) -> list[str]:
        found = subprocess.run(
            [self._programs["xdotool"], "search", "--onlyvisible", "--class", window_class],
            env=self._env, capture_output=True, timeout=XDOTOOL_TIMEOUT_S, check=False,
        )
        return found.stdout.decode().split()

    async def _await_window(self, running: desktops.Running, before: set[str], timeout: float) -> str:
        """The first visible window of ``running``'s app class not in ``before``. By class, not
        pid: a second browser hands its URL to the first one, whose process opens the window."""
        assert self._session is not None
        app = desktops.APPS[running.app]
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            return await self._poll_window(running, app, before, deadline, timeout)
        finally:
            running.pending = False

    async def _poll_window(self, running: desktops.Running, app: desktops.App, before: set[str], deadline: float,
                           timeout: float) -> str:  # fmt: skip
        assert self._session is not None
        while True:
            new = [w for w in await self._run(self._windows_of, app.window_class) if w not in before]
            if new:
                running.window = new[-1]
                return new[-1]
            failure = self._session.app_failure(running)
            if failure is not None:
                raise DisplayError(failure, ERR_FAILED)
            if asyncio.get_running_loop().time() >= deadline:
                raise DisplayError(f"{app.program} showed no window within {timeout:.0f} s; "
                                   f"{running.log_path}: {desktops.log_tail(running.log_path)}", ERR_TIMEOUT)  # fmt: skip
            await asyncio.sleep(WINDOW_POLL_S)

    async def launch(self, app: str, args: list[str], timeout: float) -> dict[str, Any]:
        if self._session is None:
            raise DisplayError("this Xvfb screen has no desktop to launch apps on (start shinkend with "
                               "--desktop)", ERR_UNSUPPORTED)  # fmt: skip
        if app not in desktops.APPS:
            raise DisplayError(f"unknown app {app!r}; the desktop has {', '.join(desktops.APPS)}", ERR_BAD_ARGS)
        before = set(await self._run(self._windows_of, desktops.APPS[app].window_class))
        running = await self._run(self._session.spawn_app, app, args)
        window = await self._await_window(running, before, timeout)
        await self._run(self._xdotool, "windowactivate", window)
        pid = await self._run(self._xdotool, "getwindowpid", window)
        return {"app": app, "pid": int(pid) if pid.strip().isdigit() else running.proc.pid, "window": int(window)}

    async def _supervise(self, session: desktops.DesktopSession) -> None:
        """Restart the window manager when it dies (at most MAX_WM_RESTARTS times) and
        forget apps the agent closed."""
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            try:
                await self._run(session.reap)
                failure = session.wm_failure()
                if failure is None:
                    continue
                if await self._run(session.restart_window_manager):
                    log.warning("%s; restarted it (%d of %d)", failure, session.wm_restarts, desktops.MAX_WM_RESTARTS)
                else:
                    log.error("%s; restarted %d times already, giving up", failure, desktops.MAX_WM_RESTARTS)
                    return
            except DisplayError as exc:  # the screen itself is gone: every call reports it
                log.error("desktop supervision stops: %s", exc)
                return

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        try:
            await asyncio.get_running_loop().run_in_executor(self._x, self._stop_sync)
        finally:
            self._x.shutdown(wait=False)

    def _stop_sync(self) -> None:
        if self._sct is not None:
            self._sct.close()
            self._sct = None
        if self._keymap is not None:
            self._keymap.close()
            self._keymap = None
        self._frames.clear()
        self._last_raw = None
        for proc in reversed(self._children):
            signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline and not all(exit_status(p) for p in self._children):
            time.sleep(0.02)
        # Exited leaders stay unreaped zombies until here, so their group ids
        # cannot be reused: this SIGKILL reaches only stragglers (a child that
        # ignored SIGTERM, xterm's shell) of groups we started.
        for proc in reversed(self._children):
            signal_group(proc, signal.SIGKILL)
            proc.wait()
        self._children.clear()
        if self._session is not None:
            self._session.remove()

    # -- pixels ----------------------------------------------------------------

    @property
    def size(self) -> tuple[int, int]:
        return (self.width, self.height)

    def _grab(self) -> bytearray:
        shot = self._sct.grab(self._sct.monitors[0])
        raw: bytearray = shot.raw  # mss.ScreenShot.raw (self._sct is Any: mss may be missing)
        if self._last_raw is None or raw != self._last_raw:
            self._generation += 1
        self._last_raw = raw
        return raw

    async def change_token(self) -> Hashable:
        return await self._run(self._change_token_sync)

    def _change_token_sync(self) -> int:
        self._grab()
        return self._generation

    async def screenshot(
        self,
        format: str = DEFAULT_IMAGE_FORMAT,
        quality: int = DEFAULT_IMAGE_QUALITY,
        max_long_edge: int | None = None,
        region: tuple[int, int, int, int] | None = None,
    ) -> EncodedImage:
        params = imaging.plan(self.width, self.height, format, quality, max_long_edge, region)
        return await self._run(self._screenshot_sync, params)

    def _screenshot_sync(self, params: imaging.EncodeParams) -> EncodedImage:
        raw = self._grab()
        geo = params.geometry
        if geo.box != (0, 0, self.width, self.height):  # a region: not tracked between shots
            image = imaging.bgrx_image(raw, self.size, (geo.x0, geo.y0, geo.width, geo.height))
            return imaging.encoded(image, params, pointer=self.draws_pointer)
        frame = self._update_frame(raw, geo)
        key = (params.format, params.quality)
        previous = frame.encodings.pop(key, None)
        if previous is None or previous.stale is None:
            encoding = imaging.BANDED[params.format].encode(frame.image, params.quality)
        else:
            encoding = previous.encoding.patched(frame.image, params.quality, previous.stale)
        frame.encodings[key] = _Encoding(encoding, [])
        while len(frame.encodings) > ENCODINGS_KEPT:
            frame.encodings.pop(next(iter(frame.encodings)))
        return imaging.described(encoding.tobytes(), params, pointer=self.draws_pointer)

    def _update_frame(self, raw: bytearray, geo: imaging.Geometry) -> _Frame:
        """The whole-screen frame at ``geo`` for capture ``raw``, patched from the
        previous one where little changed (its encodings learn what changed)."""
        frame = self._frames.pop(geo, None)
        changed = None
        if frame is not None:
            rects = imaging.changed_rects(frame.raw, raw, self.size)
            if sum(w * h for _, _, w, h in rects) <= FULL_RESCALE_FRACTION * self.width * self.height:
                patch = functools.partial(imaging.bgrx_image, raw, self.size)
                if geo.scaled:
                    changed = imaging.rescale_rects(frame.image, geo, rects, patch, self.size)
                else:
                    for rect in rects:
                        frame.image.paste(patch(rect), rect[:2])
                    changed = rects
                frame.raw = raw
                for encoding in frame.encodings.values():
                    encoding.invalidate(changed)
        if changed is None:
            frame = _Frame(raw, imaging.render(imaging.bgrx_image(raw, self.size), geo))
        assert frame is not None  # changed is set only after patching the previous frame
        self._frames[geo] = frame
        while len(self._frames) > FRAMES_KEPT:
            self._frames.popitem(last=False)
        return frame

    # -- input -----------------------------------------------------------------

    def _xdotool(self, *args: str, stdin: bytes | None = None, timeout: float = XDOTOOL_TIMEOUT_S) -> str:
        try:
            proc = subprocess.run(
                [self._programs["xdotool"], *args], env=self._env, input=stdin, capture_output=True, timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise DisplayError(f"xdotool {args[0]} timed out after {timeout:.0f} s", ERR_TIMEOUT) from None
        if proc.returncode != 0:
            message = proc.stderr.decode(errors="replace").strip()[-500:]
            raise DisplayError(f"xdotool {args[0]} failed ({proc.returncode}): {message}", ERR_FAILED)
        return proc.stdout.decode(errors="replace")

    @staticmethod
    def _button(button: str) -> str:
        try:
            return _BUTTONS[button]
        except KeyError:
            raise DisplayError(f"button must be left, middle or right, not {button!r}", ERR_BAD_ARGS) from None

    async def move(self, x: int, y: int) -> None:
        await self._run(self._xdotool, "mousemove", str(x), str(y))

    async def click(self, x: int, y: int, button: str = "left", count: int = 1) -> None:
        number = self._button(button)
        await self._run(
            self._xdotool, "mousemove", str(x), str(y), "click", "--repeat", str(count), "--delay", "60", number
        )

    async def drag(self, x0: int, y0: int, x1: int, y1: int, button: str = "left") -> None:
        number = self._button(button)
        args = ["mousemove", str(x0), str(y0), "mousedown", number]
        for step in range(1, DRAG_STEPS + 1):
            x = x0 + (x1 - x0) * step // DRAG_STEPS
            y = y0 + (y1 - y0) * step // DRAG_STEPS
            args += ["sleep", "0.01", "mousemove", str(x), str(y)]
        args += ["mouseup", number]
        await self._run(self._xdotool, *args)

    async def scroll(self, dx: int, dy: int, x: int | None = None, y: int | None = None) -> None:
        args: list[str] = []
        if x is not None and y is not None:
            args += ["mousemove", str(x), str(y)]
        # X wheel buttons: 4 up, 5 down, 6 left, 7 right.
        for clicks, negative, positive in ((dy, "4", "5"), (dx, "6", "7")):
            if clicks:
                args += ["click", "--repeat", str(abs(clicks)), "--delay", "10", positive if clicks > 0 else negative]
        if args:
            await self._run(self._xdotool, *args)

    async def type_text(self, text: str) -> None:
        if text:
            await self._run(self._type_sync, text)

    def _type_sync(self, text: str) -> None:
        # Characters outside the keymap are bound to spare keycodes first; see xkeymap.
        keymap = self._keymap
        assert keymap is not None  # set by _start_sync, before _run lets any call through
        for chunk in keymap.pool.plan(text):
            if chunk.rebinds:
                time.sleep(REBIND_SETTLE_S)
            keymap.bind(chunk.bindings)
            timeout = XDOTOOL_TIMEOUT_S + len(chunk.text) * TYPE_DELAY_MS / 1000 * 4
            self._xdotool(
                "type", "--delay", str(TYPE_DELAY_MS), "--file", "-", stdin=chunk.text.encode(), timeout=timeout
            )

    async def key(self, combo: str) -> None:
        await self._run(self._xdotool, "key", parse_combo(combo).xdotool())

    async def cursor(self) -> tuple[int, int]:
        out = await self._run(self._xdotool, "getmouselocation", "--shell")
        fields = dict(line.split("=", 1) for line in out.split() if "=" in line)
        return int(fields["X"]), int(fields["Y"])


@dataclass
class _Encoding:
    """A banded encoding of a frame's image and the image rectangles changed
    since it was made (None: too many to track, encode afresh)."""

    encoding: imaging.BandedEncoding[Any]
    stale: list[imaging.Rect] | None

    def invalidate(self, rects: list[imaging.Rect]) -> None:
        if self.stale is not None:
            self.stale.extend(rects)
            if len(self.stale) > MAX_STALE_RECTS:
                self.stale = None


@dataclass
class _Frame:
    """The last whole-screen frame at one geometry: the capture it came from,
    its image, and its encodings by (format, quality)."""

    raw: bytearray
    image: Image.Image
    encodings: dict[tuple[str, int], _Encoding] = field(default_factory=dict)
