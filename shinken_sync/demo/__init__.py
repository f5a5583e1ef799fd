"""``shinken demo``: the whole product on the embedded defaults, end to end.

It starts the session server (router + workers + the reference backend) and N
local virtual sandboxes, then runs a synchronous rollout loop in plain blocking
code, one OS thread per episode (see docs/demo.md for why threads): per turn it
asks the model through the session server's OpenAI-compatible endpoint, parses
the action the model answers with, and applies it with one pipelined
``step([action], observe=...)`` that also returns the next observation. At the
end it fetches every session's token records and writes the trajectories.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import fcntl
import hashlib
import io
import json
import math
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO, TypeVar

import requests
from tabulate import tabulate
from tqdm import tqdm

from shinken_sync.errors import SandboxDied, ShinkenError
from shinken_sync.stats import percentile
from shinken_sync.trajectory_file import compact_records
from shinken_sync.transport import TRANSPORT_ENV

_CtrlCT = TypeVar("_CtrlCT", bound="CtrlC")

OBSERVE = {"format": "jpeg", "quality": 80, "max_long_edge": 1280}
SCREEN = (1920, 1080)  # what SYSTEM_PROMPT tells the model, and the reference backend's action range
SYSTEM_PROMPT = (
    "You operate a 1920x1080 desktop. Each user message carries the latest screenshot. "
    'Answer with one action as JSON: {"action": {"verb": ..., ...}}.'
)
SERVER_START_TIMEOUT = 60.0
# One instruction per episode (cycled), so episodes diverge: the reference model is a
# deterministic function of the prompt, and identical prompts would give identical rollouts.
TASKS = (
    "Type a short note into the text field.",
    "Turn on every checkbox.",
    "Scroll the file list to the bottom.",
    "Press each toolbar button once.",
    "Drag the slider to the middle.",
    "Open the menu and close it again.",
)
HTTP_TIMEOUT = (5.0, 120.0)  # (connect, read) for every call to the session server
# An action is a few dozen tokens; a model that rambles (random weights) is cut here, not at the
# engine's context length.
MAX_ACTION_TOKENS = 256


class DemoError(Exception):
    """The demo could not start or run; the message says what to do."""


class InvalidAction(DemoError):
    """The model's reply is not an action the demo can take: the step records it (outcome
    ``skipped``, this error) and the episode goes on with the same screen."""


def plural(count: int, one: str, many: str = "") -> str:
    """``1 sandbox``, ``2 sandboxes``."""
    return f"{count} {one if count == 1 else many or one + 's'}"


class CtrlC:
    """Ctrl-C (SIGINT) as a count that the caller's wait loop polls, instead of a
    KeyboardInterrupt raised at whatever bytecode runs: a stop must still close every sandbox,
    stop the session server and write the outputs. From the ``raise_from``-th Ctrl-C on it
    raises KeyboardInterrupt after all (1: Python's own behaviour, for start-up, where there is
    nothing to keep; None: never); the attribute may change while it is installed. Outside
    the main thread (no signal handlers there) it counts nothing.

    Ray mode: an exception raised inside Ray's client calls (a lock held, a reply half-read)
    may leave the driver unable to make its next Ray call, the ``stop`` it must send; Ray
    defers SIGINT around such regions itself (``ray._private.utils.DeferSigint``).
    """

    def __init__(self, raise_from: int | None = None) -> None:
        self.count = 0
        self.raise_from = raise_from
        self._previous: Any = None

    def _handle(self, _signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        if self.raise_from is not None and self.count >= self.raise_from:
            # Said before the stop runs (os.write: no buffered stream is re-entered from a handler).
            os.write(sys.stderr.fileno(), b"\nshinken demo: interrupted; stopping now\n")
            raise KeyboardInterrupt

    def __enter__(self: _CtrlCT) -> _CtrlCT:  # noqa: PYI019 - no typing.Self on 3.10
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


# The session server's settings the demo passes as flags: their SHINKEN_<NAME> changes nothing.
_SERVER_FLAGS = ("workers", "data_dir")
_SECRET_SETTINGS = ("api_key",)


def environment_overrides(environ: Mapping[str, str] | None = None, *, starts_server: bool = True) -> list[str]:
    """``NAME=value`` of each environment variable that changes this run (the session server's
    ``SHINKEN_<NAME>`` settings when the demo starts it, the SDK's transport), secrets masked.
    Raises :class:`DemoError` for a setting that does not parse (the server would refuse it)."""
    env = os.environ if environ is None else environ
    shown = []
    if starts_server:
        from webapp.settings import SETTINGS, values_from_env

        try:
            values_from_env(env)
        except ValueError as exc:
            raise DemoError(f"{exc} (the demo's session server reads it): fix or unset it") from None
        for setting in SETTINGS:
            name = setting.env_var
            if name is not None and name in env and setting.name not in _SERVER_FLAGS:
                shown.append(f"{name}={'***' if setting.name in _SECRET_SETTINGS else env[name]}")
    if TRANSPORT_ENV in env:
        shown.append(f"{TRANSPORT_ENV}={env[TRANSPORT_ENV]}")
    return shown


def report_environment(overrides: list[str]) -> None:
    if overrides:
        print(f"shinken demo: the environment changes this run: {', '.join(overrides)}", file=sys.stderr)


@dataclass
class Episode:
    index: int
    sandbox_id: str
    session_id: str = ""
    steps: list[dict[str, Any]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    final_jpeg: bytes = b""  # the last screenshot the model got (as the server returned it), or observed
    sent_images: list[str] = field(default_factory=list)  # sha256 of the screenshot sent each turn
    images: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes, from the session server
    first_observation: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    finished: bool = False
    interrupted: bool = False


# ---------------------------------------------------------------------------
# The session server, as a child process


def _check_port_free(host: str, port: int) -> None:
    # An early, demo-worded refusal of a taken --port (before any sandbox starts); port 0 is
    # bound by the session server itself, which reports it: no free-port race.
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise DemoError(f"cannot use {host}:{port} for the session server: {exc.strerror}; "
                            f"pass --port with a free port (or 0 for any)") from exc


def start_session_server(workers: int, port: int, log_path: Path, host: str = "127.0.0.1",
                         engine: Sequence[str] = ()) -> Any:
    """``shinken-session-server`` with its embedded reference backend on loopback (or, with
    ``engine``, the flags ``--backend-url URL [--tokenizer DIR] [--backend-kind KIND]``, in front of
    that engine: the launcher checks it and says what is wrong in one line), started
    through its one launcher (``webapp.serve.start_session_server``; imported here, so that
    ``shinken_sync`` never imports ``webapp`` at import time). Returns at once: the caller
    waits with ``wait_ready()`` while its sandboxes start. Its data directory (the sessions'
    journals) is ``session-data/`` beside the log, in the demo's output directory.

    It runs in its own session (a terminal's Ctrl-C reaches only the demo, which stops it in
    order) and dies with the demo however the demo dies (see webapp.serve). Started from the
    main thread, which lives as long as the demo (see shinken_sync.lifetime).
    """
    from webapp.serve import start_session_server as launch

    return launch(workers, None, f"{host}:{port}", "--data-dir", str(log_path.parent / SESSION_DATA), *engine,
                  log_path=log_path, own_session=True, wait=False)


def wait_ready(server: Any, timeout: float = SERVER_START_TIMEOUT) -> str:
    """The session server's URL once it is ready; :class:`DemoError` saying why if it is not."""
    from webapp.serve import SessionServerNotReady

    try:
        url: str = server.wait_ready(timeout)  # a webapp.serve.SessionServerProcess (Any: webapp loads late)
        return url
    except SessionServerNotReady as exc:
        raise DemoError(f"{exc}; its log: {server.log_path}") from None


# ---------------------------------------------------------------------------
# One episode


def describe(obs: Any, turn: int, last: dict[str, Any] | None) -> str:
    """The text beside one turn's screenshot: the turn, the image's size and digest, the last action."""
    digest = hashlib.sha256(obs.data).hexdigest()[:16]
    text = (f"Turn {turn}. Screenshot {obs.width}x{obs.height} {obs.format}, {len(obs.data)} bytes, "
            f"sha256 {digest}, scale {obs.scale:g}.")
    if last is not None:
        text += f" Last action {json.dumps(last['action'], sort_keys=True)} -> {last['outcome']}."
    return text


def observation_message(obs: Any, turn: int, last: dict[str, Any] | None, images: bool = True) -> dict[str, Any]:
    """One turn's user message: the text and the screenshot as an OpenAI image part (the JPEG
    the sandbox returned, as a data URL: the session server fetches nothing); the text alone
    when the engine takes no images (the server's ready line says which)."""
    if not images:
        return {"role": "user", "content": describe(obs, turn, last)}
    url = f"data:image/{obs.format};base64," + base64.b64encode(obs.data).decode("ascii")
    return {"role": "user", "content": [{"type": "text", "text": describe(obs, turn, last)},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def parse_action(content: str) -> dict[str, Any]:
    """The reference backend's action format: ``{"action": {"verb": ..., ...}}`` (docs/session-server.md)."""
    try:
        action = json.loads(content)["action"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidAction(f"model reply is not an action: {content[:200]!r}") from exc
    if not isinstance(action, dict) or not isinstance(action.get("verb"), str):
        raise InvalidAction(f"model action has no verb: {str(action)[:200]!r}")
    return action


def action_or_none(content: str) -> dict[str, Any] | None:
    """The reply's action, or None when it is not one (the step then says so)."""
    try:
        return parse_action(content)
    except InvalidAction:
        return None


def error_info(exc: BaseException | None) -> dict[str, str] | None:
    """A step row's error as JSON: its class (what a caller branches on), kind and message."""
    if exc is None:
        return None
    return {"type": type(exc).__name__, "kind": getattr(exc, "kind", ""), "message": str(exc)}


def obs_meta(obs: Any) -> dict[str, Any]:
    return {"format": obs.format, "width": obs.width, "height": obs.height, "scale": obs.scale,
            "bytes": len(obs.data), "sha256": hashlib.sha256(obs.data).hexdigest()}


def run_episode(ep: Episode, sandbox: Any, server: str, turns: int, http: requests.Session,
                stop: threading.Event, progress: Progress, images: bool = True) -> None:
    reply = http.post(f"{server}/sessions", timeout=HTTP_TIMEOUT)
    reply.raise_for_status()
    ep.session_id = reply.json()["session_id"]
    t0 = time.monotonic()
    obs = sandbox.screenshot(**OBSERVE)
    progress.observed(time.monotonic() - t0)
    ep.first_observation = obs_meta(obs)
    task = TASKS[ep.index % len(TASKS)]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"{SYSTEM_PROMPT} Episode {ep.index}. Task: {task}"}
    ]
    last: dict[str, Any] | None = None
    for turn in range(turns):
        if stop.is_set():  # Ctrl-C: keep the turns taken so far, records included
            ep.interrupted = True
            break
        messages.append(observation_message(obs, turn, last, images))
        if images:
            ep.sent_images.append(hashlib.sha256(obs.data).hexdigest())
        else:
            ep.final_jpeg = obs.data
        t0 = time.monotonic()
        chat = http.post(f"{server}/sessions/{ep.session_id}/v1/chat/completions",
                         json={"model": "reference", "messages": messages, "max_tokens": MAX_ACTION_TOKENS},
                         timeout=HTTP_TIMEOUT)
        if chat.status_code != 200:
            raise DemoError(f"chat turn {turn} failed with {chat.status_code}: {chat.text[:300]}")
        content = chat.json()["choices"][0]["message"]["content"]
        progress.chatted(time.monotonic() - t0)
        messages.append({"role": "assistant", "content": content})
        try:
            action = parse_action(content)
        except InvalidAction as exc:  # recorded, and the model sees the same screen again
            last = {"action": None, "outcome": "skipped"}
            ep.steps.append({"turn": turn, "action": None, "outcome": "skipped", "error": error_info(exc),
                             "step_latency_s": None})
            progress.stepped(None, "skipped")
            continue
        t0 = time.monotonic()
        result = sandbox.step([action], observe=OBSERVE)
        elapsed = time.monotonic() - t0
        row = result.rows[0]
        if isinstance(row.error, SandboxDied):  # every later turn would fail the same way
            raise row.error
        last = {"action": action, "outcome": row.outcome}
        step = {"turn": turn, "action": action, "outcome": row.outcome, "error": error_info(row.error),
                "step_latency_s": round(elapsed, 4)}
        if result.observation is not None:
            obs = result.observation
            step["observation"] = obs_meta(obs)
        ep.steps.append(step)
        progress.stepped(elapsed, row.outcome)
    # The records name each screenshot by sha256; the pixels come once each, beside them.
    got = http.get(f"{server}/sessions/{ep.session_id}", params={"images": "1"}, timeout=HTTP_TIMEOUT)
    got.raise_for_status()
    body = got.json()
    ep.records = body["records"]
    ep.metadata = body["metadata"]
    ep.images = {digest: base64.b64decode(image["data"]) for digest, image in body.get("images", {}).items()}
    if ep.sent_images:
        ep.final_jpeg = ep.images.get(ep.sent_images[-1], b"")
    ep.finished = True


def observation_changes(ep: Episode) -> int:
    """Steps after which the screen differed from the one before (sha256 of the observation)."""
    last, changes = ep.first_observation.get("sha256"), 0
    for step in ep.steps:
        digest = (step.get("observation") or {}).get("sha256")
        if digest is not None:
            changes += digest != last
            last = digest
    return changes


def check_episode(ep: Episode) -> dict[str, Any]:
    """Do the token records agree with the steps taken? (the demo's own consistency check)"""
    acc = ep.metadata.get("accumulated_token_ids", [])
    last = ep.records[-1] if ep.records else {}
    # miles' SessionRecord: prompt ids are the backend request's input_ids, output ids the
    # second element of each meta_info.output_token_logprobs pair.
    pairs = last["response"]["choices"][0]["meta_info"]["output_token_logprobs"] if last else []
    expected = list(last.get("request", {}).get("input_ids", [])) + [pair[1] for pair in pairs]
    actions_match = len(ep.records) == len(ep.steps) and all(
        action_or_none(rec["response"]["choices"][0]["message"]["content"]) == step["action"]
        for rec, step in zip(ep.records, ep.steps)
    )
    return {"records": len(ep.records), "steps": len(ep.steps),
            "actions_taken": sum(step["action"] is not None for step in ep.steps),
            "accumulated_matches_last_record": bool(acc) and acc == expected,
            "actions_match_records": actions_match,
            "images_match_records": images_match(ep),
            "observation_changes": observation_changes(ep)}


def images_match(ep: Episode) -> bool:
    """Each record's ``image_data`` names the screenshots sent up to its turn, in order, and the
    session server returned each of them with exactly those bytes."""
    refs = [f"sha256:{digest}" for digest in ep.sent_images]
    return all((rec["request"].get("image_data") or []) == refs[:k + 1] for k, rec in enumerate(ep.records)) and all(
        hashlib.sha256(ep.images.get(digest, b"")).hexdigest() == digest for digest in ep.sent_images)


def run_consistent(episodes: list[Episode]) -> bool:
    """Every episode's records agree with its steps, and the screens changed at least once in
    the run if any action was taken (a display showing nothing, e.g. an empty X screen, gives
    identical observations whatever the agent does: such a run tested nothing; a model that
    answered no action moved nothing)."""
    checks = [check_episode(ep) for ep in episodes]
    records_ok = all(all(v for v in check.values() if isinstance(v, bool)) for check in checks)
    acted = sum(check["actions_taken"] for check in checks)
    return records_ok and (acted == 0 or sum(check["observation_changes"] for check in checks) > 0)


# ---------------------------------------------------------------------------
# Progress and the summary


class Progress:
    """Step counters and latencies of the run, and the progress bar (tqdm) on ``stream``."""

    def __init__(self, total: int, stream: TextIO = sys.stderr):
        self.total = total
        self.done = 0
        self.latencies: list[float] = []
        self.observes: list[float] = []
        self.chats: list[float] = []
        self.outcomes: dict[str, int] = {}
        self.started = time.monotonic()
        self.finished: float | None = None
        self._lock = threading.Lock()
        tty = stream.isatty()
        # A log file gets a line every 2 s, a terminal a redraw every 0.1 s.
        self._bar = tqdm(total=total, file=stream, unit="step", ascii=not tty, dynamic_ncols=tty,
                         mininterval=0.1 if tty else 2.0, smoothing=0.1)  # fmt: skip

    def start(self) -> None:
        """Start the rollout clock (process start-up is not part of steps/s)."""
        self.started = time.monotonic()
        self._bar.reset(total=self.total)

    def finish(self) -> None:
        self.finished = time.monotonic()
        self._bar.close()

    def elapsed(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def chatted(self, seconds: float) -> None:
        with self._lock:
            self.chats.append(seconds)

    def observed(self, seconds: float) -> None:
        with self._lock:
            self.observes.append(seconds)

    def stepped(self, seconds: float | None, outcome: str) -> None:
        """One step done; ``seconds`` None: nothing was sent to the sandbox (no action)."""
        with self._lock:
            self.done += 1
            if seconds is not None:
                self.latencies.append(seconds)
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            self._bar.update(1)


def _percentile_or_nan(values: list[float], q: float) -> float:
    """The one percentile definition (:func:`shinken_sync.stats.percentile`); NaN for no data."""
    return percentile(values, q) if values else float("nan")


CONTACT_SHEET_TILES = 16  # above this many episodes the sheet shows an even sample of them
_TILE = (480, 270)
_CAPTION_FONT_PX = 16


def describe_step(step: dict[str, Any] | None) -> str:
    """A step as a person reads it: ``click (812, 440) -> ok``."""
    if step is None:
        return "no step taken"
    action = step["action"]
    if action is None:  # the model answered no action
        return f"no action -> {step['outcome']} ({step['error']['type']})"
    verb = action.get("verb", "?")
    if "x" in action and "y" in action:
        what = f"{verb} ({action['x']}, {action['y']})"
        if verb == "scroll":
            what += f" dy {action.get('dy', 0)}"
    elif verb == "type":
        what = f"type {action.get('text', '')!r}"
    elif verb == "key":
        what = f"key {action.get('combo', '')}"
    else:
        what = verb
    outcome = step["outcome"]
    if step.get("error"):
        outcome += f" ({step['error']['type']})"
    return f"{what} -> {outcome}"


def _caption_font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 with FreeType: a scalable font
    except (TypeError, OSError):  # older Pillow or no FreeType: the fixed bitmap font
        return ImageFont.load_default()


def contact_sheet(episodes: list[Episode], path: Path, total: int | None = None) -> None:
    """Each episode's last screenshot the model got (the pixels the session server returned) with,
    above it, the episode, its turns and the action the model chose from it with the outcome; more than CONTACT_SHEET_TILES episodes are sampled evenly and the header says so."""
    from PIL import Image, ImageDraw

    shots = [ep for ep in episodes if ep.final_jpeg]
    total = len(episodes) if total is None else total
    if len(shots) > CONTACT_SHEET_TILES:
        step = len(shots) / CONTACT_SHEET_TILES
        shots = [shots[int(i * step)] for i in range(CONTACT_SHEET_TILES)]
    font = _caption_font(_CAPTION_FONT_PX)
    line = _CAPTION_FONT_PX + 4
    caption, header = 2 * line + 6, line + 8
    cols = max(1, math.ceil(math.sqrt(len(shots))))
    rows = max(1, math.ceil(len(shots) / cols))
    tile_h = _TILE[1] + caption
    sheet = Image.new("RGB", (cols * _TILE[0], header + rows * tile_h), "white")
    draw = ImageDraw.Draw(sheet)
    shown = f"showing {len(shots)} of {total} episodes" if len(shots) < total else f"{total} episodes"
    draw.text((6, 4), f"shinken demo: the last screenshot the model got, per episode ({shown})", fill="black",
              font=font)
    for i, ep in enumerate(shots):
        x, y = (i % cols) * _TILE[0], header + (i // cols) * tile_h
        img = Image.open(io.BytesIO(ep.final_jpeg)).convert("RGB")
        img.thumbnail(_TILE)
        sheet.paste(img, (x, y + caption))
        draw.rectangle((x, y + caption, x + img.width - 1, y + caption + img.height - 1), outline="gray")
        status = "interrupted" if ep.interrupted else f"{len(ep.steps)} turns"
        for row, text in enumerate((f"episode {ep.index}  ({status}, session {ep.session_id[:8]})",
                                    f"last: {describe_step(ep.steps[-1] if ep.steps else None)}")):
            while len(text) > 4 and draw.textlength(text, font=font) > _TILE[0] - 8:  # fits its tile
                text = text[:-2] + "…"
            draw.text((x + 4, y + 2 + row * line), text, fill="black", font=font)
    sheet.save(path)


# ---------------------------------------------------------------------------
# Entry point


def display_args(display: str) -> list[str]:
    """shinkend flags for ``display``: on an X screen, a program that shows every action (an
    empty X screen stays black whatever the agent does)."""
    if display != "xvfb":
        return []
    from shinken_sync.demo.screen import xterm_argv

    return ["--launch", shlex.join(xterm_argv(*SCREEN, title="shinken demo"))]


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The session server's engine flags from ``--backend-url``, ``--tokenizer``, ``--backend-kind``
    (none: the embedded reference backend)."""
    flags = []
    for name in ("backend_url", "tokenizer", "backend_kind"):
        value = getattr(args, name, None)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def check_display(display: str) -> None:
    """Everything ``display`` needs here, all of it reported at once, before anything starts."""
    if display != "xvfb":
        return
    from shinken_sync.daemon.display.xvfb import REQUIRED_PROGRAMS, missing_prerequisites

    problem = missing_prerequisites((*REQUIRED_PROGRAMS, "xterm"))
    if problem is not None:
        raise DemoError(f"--display xvfb: {problem}; or use --display virtual")


def provider_config(spec: str, display: str) -> Any:
    """The ``--provider`` value as a provider config: a type name (``local``, ``isolated``)
    gets the demo's screen and ``--display`` with its programs; a JSON object (inline, or
    ``@FILE``) is taken as written (docs/sandboxes.md), its display fields defaulting to
    the same. :class:`DemoError` for anything else."""
    from shinken_sync.providers.config import CONFIGS, config_from_dict
    from shinken_sync.providers.errors import ProviderConfigError

    text = spec
    if spec.startswith("@"):
        try:
            text = Path(spec[1:]).read_text()
        except OSError as exc:
            raise DemoError(f"--provider {spec}: cannot read {spec[1:]}: {exc.strerror}") from None
    try:
        data = json.loads(text) if text.lstrip().startswith("{") else {"type": text}
    except ValueError as exc:
        raise DemoError(f"--provider {spec}: not a provider type nor a JSON object ({exc})") from None
    if not isinstance(data, dict):
        raise DemoError(f"--provider {spec}: a provider config is a JSON object")
    if data.get("type") not in ("local", "isolated"):
        raise DemoError(f"--provider runs episodes on 'local' or 'isolated' sandboxes, not {data.get('type')!r} "
                        f"(known provider types: {sorted(CONFIGS)}; for Ray use --ray)")
    data = {"display": display, "screen": list(SCREEN), "extra_args": display_args(display), **data}
    try:
        return config_from_dict(data)
    except ProviderConfigError as exc:
        raise DemoError(f"--provider: {exc}") from None


_held_out: dict[Path, int] = {}  # output folder -> the fd holding its lock, for this process's life


def prepare_out(path: str) -> Path:
    """The output folder, created (with its parents) if missing; never a file.

    It is locked (``flock`` on the folder itself, held for this process's life), so a second
    demo on the same folder is refused at once. A previous demo's outputs in it (only the names
    in :data:`DEMO_OUTPUTS`) are removed, so runs never mix (old images, old sessions restored
    into this run); a folder holding anything else is refused: the demo never deletes what it
    did not write.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {path} is a file, not a folder; pass --out with a folder (new, empty, "
                        f"or a previous demo's)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise DemoError(f"cannot write to --out {path}: {exc.strerror or exc}; pass --out with a writable folder") \
            from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise DemoError(f"--out {path} is in use by another shinken demo; pass --out with another folder") from None
    try:
        foreign = sorted(entry.name for entry in out.iterdir() if entry.name not in DEMO_OUTPUTS)
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise DemoError(f"--out {path} holds files no demo wrote ({shown}); pass --out with a new or empty "
                            f"folder (a previous demo's outputs are replaced, nothing else is deleted)")
        probe = out / ".shinken-demo-write-test"
        probe.touch()
        probe.unlink()
        previous = [entry for entry in out.iterdir() if entry.name in DEMO_OUTPUTS]
        for entry in previous:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    except OSError as exc:
        os.close(fd)
        raise DemoError(f"cannot write to --out {path}: {exc.strerror or exc}; pass --out with a writable folder") \
            from None
    except DemoError:
        os.close(fd)
        raise
    if previous:
        print(f"shinken demo: --out {path}: replaced a previous run's outputs", file=sys.stderr)
    _held_out[out.resolve()] = fd
    return out


def run(args: argparse.Namespace) -> int:
    """The single-process rollout; ``shinken demo --ray`` runs :mod:`shinken_sync.demo.ray_cluster` instead
    (chosen by ``shinken_sync.cli``: that module builds on this one, so this one never imports it)."""
    from shinken_sync.providers.config import make_provider
    from webapp.settings import BY_NAME

    # Every check before anything is created or started.
    check_display(args.display)
    config = provider_config(getattr(args, "provider", "local"), args.display)
    if args.port:
        _check_port_free("127.0.0.1", args.port)
    overrides = environment_overrides()
    out = prepare_out(args.out)

    kind = config.display if config.type == "local" else f"{config.type} {config.display}"
    print(f"shinken demo: {plural(args.sandboxes, kind + ' sandbox', kind + ' sandboxes')} x "
          f"{plural(args.turns, 'turn')}, session server with {plural(args.workers, 'worker')} -> {out}/",
          file=sys.stderr)
    report_environment(overrides)
    ctrl_c = CtrlC(raise_from=1)  # start-up: Ctrl-C aborts at once (nothing to keep yet)
    stop = threading.Event()
    aborted = False
    episodes: list[Episode] = []
    progress = Progress(args.sandboxes * args.turns)
    with ctrl_c:
        server = start_session_server(args.workers, args.port, out / SERVER_LOG, engine=engine_flags(args))
        provider = None
        sandboxes: list[Any] = []
        viewer = None  # shinken_sync.fleet_view.FleetPublisher with --view
        http = requests.Session()
        try:
            provider = make_provider(config)
            handles = provider.create_many(args.sandboxes)
            url = wait_ready(server)
            images = bool(server.ready_line.get("images", True))  # False: a text-only engine (vLLM)
            for i, handle in enumerate(handles):
                sandboxes.append(provider.connect(handle))
                episodes.append(Episode(index=i, sandbox_id=str(provider.endpoint(handle)[0])))
            http.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=max(10, args.sandboxes)))
            if key := os.environ.get(BY_NAME["api_key"].env_var or ""):  # the session server then requires it
                http.headers["Authorization"] = f"Bearer {key}"

            def worker(ep: Episode, sb: Any) -> None:
                try:
                    run_episode(ep, sb, url, args.turns, http, stop, progress, images)
                except Exception as exc:  # noqa: BLE001 (one failing episode never stops the others)
                    if not aborted:  # after a second Ctrl-C calls fail because everything stops
                        ep.error = f"{type(exc).__name__}: {exc}"

            if getattr(args, "view", False):  # the live fleet on the server's viewer (docs/viewer.md)
                from shinken_sync.demo import view as demo_view

                viewer = demo_view.start(url, sandboxes, [f"episode {ep.index} · {ep.sandbox_id}" for ep in episodes],
                                         api_key=key or None)
            ctrl_c.raise_from = None  # from here on a Ctrl-C stops the rollout and the outputs are written
            progress.start()
            pool = ThreadPoolExecutor(max_workers=args.sandboxes, thread_name_prefix="episode")
            futures = [pool.submit(worker, ep, sb) for ep, sb in zip(episodes, sandboxes)]
            while not all(f.done() for f in futures):
                if ctrl_c.count >= 2:
                    aborted = True
                    # What is finished now is what gets written; the rest stops with the processes.
                    episodes = [copy.copy(ep) if ep.finished else _cut_short(ep) for ep in episodes]
                    print("\nshinken demo: stopping now; writing the episodes finished so far (the others' "
                          f"records stay in {out / SESSION_DATA}/)", file=sys.stderr)
                    break
                if ctrl_c.count == 1 and not stop.is_set():
                    stop.set()
                    print("\nshinken demo: interrupted; finishing the turns in flight and fetching every "
                          "episode's records so far (Ctrl-C again: stop now)", file=sys.stderr)
                time.sleep(0.05)
            pool.shutdown(wait=not aborted, cancel_futures=True)
            progress.finish()
            if viewer is not None and not (stop.is_set() or aborted):
                demo_view.hold(viewer, lambda: ctrl_c.count > 0)
        finally:
            ctrl_c.raise_from = None  # stopping and writing are never cut short
            if viewer is not None:
                viewer.close()
            # Its keep-alive connections first: gunicorn's graceful stop waits for them (keepalive, 5 s).
            http.close()
            for sb in sandboxes:
                with contextlib.suppress(ShinkenError):  # a dead sandbox is already closed
                    sb.close()
            if provider is not None:
                provider.close()
            server.close(timeout=5 if aborted else 15)
        return write_outputs(out, episodes, progress, interrupted=stop.is_set() or aborted)


def _cut_short(ep: Episode) -> Episode:
    """An unfinished episode as the second Ctrl-C found it: its steps so far, no records."""
    return Episode(index=ep.index, sandbox_id=ep.sandbox_id, session_id=ep.session_id, steps=list(ep.steps),
                   first_observation=ep.first_observation, error=ep.error, interrupted=True)


TRAJECTORIES = "trajectories.jsonl"
ROUTED_EXPERTS = "routed_experts.bin"
IMAGES_DIR = "images"  # each screenshot the model got, once: images/<sha256>.jpg
CONTACT_SHEET = "contact_sheet.png"
SUMMARY = "summary.json"
SERVER_LOG = "session-server.log"
SESSION_DATA = "session-data"  # the session server's data directory: every session's journal
#: Everything a demo writes into ``--out``; a later run replaces exactly these.
DEMO_OUTPUTS = frozenset({TRAJECTORIES, ROUTED_EXPERTS, IMAGES_DIR, CONTACT_SHEET, SUMMARY, SERVER_LOG,
                          SESSION_DATA})


def write_outputs(out: Path, episodes: list[Episode], progress: Progress, interrupted: bool) -> int:
    elapsed = progress.elapsed()
    finished = [ep for ep in episodes if ep.finished]
    (out / IMAGES_DIR).mkdir(exist_ok=True)
    with open(out / TRAJECTORIES, "w") as f, open(out / ROUTED_EXPERTS, "wb") as r3:
        for ep in finished:
            for digest, data in ep.images.items():
                path = out / IMAGES_DIR / f"{digest}.jpg"
                if not path.exists():
                    path.write_bytes(data)
            line = {"episode": ep.index, "sandbox": ep.sandbox_id, "session_id": ep.session_id,
                    "interrupted": ep.interrupted, "first_observation": ep.first_observation, "steps": ep.steps,
                    "records": compact_records(ep.records, r3, ROUTED_EXPERTS), "metadata": ep.metadata,
                    "check": check_episode(ep)}
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    if finished:
        contact_sheet(finished, out / CONTACT_SHEET, total=len(episodes))
    errors = {ep.index: ep.error for ep in episodes if ep.error}
    outcomes = dict(progress.outcomes)
    if errors:
        outcomes["episode_error"] = len(errors)
    summary = {
        "episodes": len(finished), "episodes_started": len(episodes), "interrupted": interrupted,
        # stopped by Ctrl-C before their last turn (records kept), or never finished (second Ctrl-C)
        "episodes_cut_short": sum(1 for ep in episodes if ep.interrupted or not ep.finished and not ep.error),
        "steps": progress.done, "rollout_s": round(elapsed, 3),
        "steps_per_s": round(progress.done / max(elapsed, 1e-9), 3),
        "step_latency_p50_s": round(_percentile_or_nan(progress.latencies, 50), 4),
        "step_latency_p95_s": round(_percentile_or_nan(progress.latencies, 95), 4),
        "chat_latency_p50_s": round(_percentile_or_nan(progress.chats, 50), 4),
        "chat_latency_p95_s": round(_percentile_or_nan(progress.chats, 95), 4),
        "observe_latency_p50_s": round(_percentile_or_nan(progress.observes, 50), 4),
        "observe_latency_p95_s": round(_percentile_or_nan(progress.observes, 95), 4),
        "outcomes": outcomes, "episode_errors": errors,
        "observation_changes": sum(observation_changes(ep) for ep in episodes),
        "consistent": run_consistent(finished),
    }
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary, out)
    if interrupted:
        return 130
    return 0 if not errors and summary["consistent"] else 1


def print_table(s: dict[str, Any], out: Path) -> None:
    rows = [
        ("episodes", f"{s['episodes']}/{s['episodes_started']} finished"
                     + (f", INTERRUPTED by Ctrl-C ({s['episodes_cut_short']} cut short)" if s["interrupted"] else "")),
        ("steps", s["steps"]),
        ("steps/s", s["steps_per_s"]),
        ("step (act+observe) p50/p95", f"{s['step_latency_p50_s'] * 1e3:.1f} / {s['step_latency_p95_s'] * 1e3:.1f} ms"),
        ("chat turn p50/p95", f"{s['chat_latency_p50_s'] * 1e3:.1f} / {s['chat_latency_p95_s'] * 1e3:.1f} ms"),
        ("first observe p50/p95", f"{s['observe_latency_p50_s'] * 1e3:.1f} / {s['observe_latency_p95_s'] * 1e3:.1f} ms"),
        ("outcomes", ", ".join(f"{k}={v}" for k, v in sorted(s["outcomes"].items())) or "-"),
        ("screen changed", f"after {s['observation_changes']} of {s['steps']} steps"),
        ("records consistent", "yes" if s["consistent"] else "NO"),
        ("outputs", str(out)),
    ]
    print(tabulate(rows, tablefmt="plain", disable_numparse=True))
    for idx, err in s["episode_errors"].items():
        print(f"episode {idx} failed: {err}", file=sys.stderr)
    if s["steps"] and not s["observation_changes"]:
        print("shinken demo: no step changed any screen, so the run tested nothing: the display shows "
              "nothing the actions act on", file=sys.stderr)
