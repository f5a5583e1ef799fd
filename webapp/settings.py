"""The session server's settings, each declared once in :data:`SETTINGS` (gunicorn's ``Setting``
table is the model): name, type, default, environment variable, launcher flag, scope and doc line.

Everything else derives from the table:

- ``shinken-session-server``'s options (:func:`add_arguments`) and the environment it hands
  gunicorn (:func:`launcher_env`): a flag wins over ``SHINKEN_<NAME>``, which wins over the default;
- the environment readers (:func:`values_from_env`) behind ``RouterConfig.from_env`` (router
  mode), the single-process app and ``HttpLimits.from_env`` (both modes);
- the worker's config: the router hands every worker ALL ``core`` settings (``RouterConfig.core``,
  filled with :func:`scope_values`), so a core setting works in both modes by construction;
- the table in ``docs/session-server-ops.md`` (:func:`docs_table`; a test keeps them equal).

Scopes: ``core`` = a field of ``webapp.core.CoreConfig`` (every session core: the single-process
app's, each router worker's); ``router`` = ``webapp.router.RouterConfig`` (router mode only);
``http`` = ``webapp.http_limits.HttpLimits`` (both modes); ``launcher`` = read by whoever starts
the server or its embedded reference backend. A test checks that each config dataclass has
exactly its scope's fields, with the table's defaults: adding a setting is one table entry
plus the field.

Imports nothing of the session core or the tokenizers, so the router may use it.
"""

from __future__ import annotations

import argparse
import enum
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["BY_NAME", "ENV_PREFIX", "MAX_BODY_BYTES", "SETTINGS", "Scope", "Setting", "add_arguments", "default",
           "defaults", "docs_table", "embedded_replay_layers", "given_values", "launcher_env", "parse_bind",
           "scope_values", "values_from_env"]

ENV_PREFIX = "SHINKEN_"
# Not a setting: the request body cap of every HTTP entry (router, single-process app, reference
# backend). Computer-use turns carry base64 screenshots; a few dozen 1080p PNGs fit well within.
MAX_BODY_BYTES = 256 << 20
DEFAULT_HOST = "127.0.0.1"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


class Scope(enum.Enum):
    CORE = "core"
    ROUTER = "router"
    HTTP = "http"
    LAUNCHER = "launcher"


@dataclass(frozen=True)
class Setting:
    name: str  # the config field; env SHINKEN_<NAME>, flag --<name-with-dashes>
    kind: type  # int, float, bool or str (the type of a value that is not None)
    default: Any  # None: off / derived, as ``doc`` says
    scope: Scope
    doc: str
    minimum: float | None = None  # numbers: the smallest legal value
    choices: tuple[str, ...] | None = None  # strings: the legal values
    pattern: str | None = None  # strings: a regular expression the whole value must match
    cli: bool = True  # has a launcher flag
    env: bool = True  # is read from the environment

    @property
    def env_var(self) -> str | None:
        return ENV_PREFIX + self.name.upper() if self.env else None

    @property
    def flag(self) -> str | None:
        return "--" + self.name.replace("_", "-") if self.cli else None

    def parse(self, raw: str) -> Any:
        """``raw`` as this setting's value. Raises ``ValueError`` saying what is wanted."""
        text = raw.strip()
        if self.kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError(f"must be a boolean (1/0, true/false), got {raw!r}")
            return text.lower() in _TRUE
        if self.kind is str:
            if self.choices is not None and text not in self.choices:
                raise ValueError(f"must be one of {', '.join(self.choices)}, got {raw!r}")
            if self.pattern is not None and text and not re.fullmatch(self.pattern, text):
                raise ValueError(f"must match {self.pattern}, got {raw!r}")
            return text or None
        try:
            value = self.kind(text)
        except ValueError:
            raise ValueError(f"must be {'a whole number' if self.kind is int else 'a number'}, got {raw!r}") from None
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"must be >= {self.minimum:g}, got {raw!r}")
        return value


_S, _C, _R, _H, _L = Setting, Scope.CORE, Scope.ROUTER, Scope.HTTP, Scope.LAUNCHER
# A samples hook's selector: a table name, package.module.function or package.module:function
# (the launcher then imports it once: webapp.tree_samples.SampleHooks.resolve).
_HOOK_SELECTOR = r"[A-Za-z_][A-Za-z0-9_.]*(:[A-Za-z_][A-Za-z0-9_.]*)?"

# The table. Order is the --help and docs order. Defaults are stated here and nowhere else.
SETTINGS: tuple[Setting, ...] = (
    # -- launcher: who starts the server (and its embedded reference backend) -------------------
    _S("workers", int, 1, _R, "session worker processes (0: the single-process server, its one shard in the router's own process)", minimum=0),
    _S("reference_r3_layers", int, 4, _L, "routed-expert layers the embedded reference backend returns per "
       "token (0: none; ignored with a backend URL); routing replay follows it unless set", minimum=0),
    _S("reference_r3_topk", int, 8, _L, "routed experts per layer and token of the embedded reference backend",
       minimum=1),
    _S("backend_wait", float, 600.0, _L, "seconds start-up waits for an engine that accepts connections but "
       "does not answer yet (vLLM opens its port before it loads the model); a refused one fails at once",
       minimum=0),
    # -- core: every session core (single-process app, each router worker) ----------------------
    _S("backend_url", str, None, _C, "inference backend base URL (unset: start the embedded reference backend)"),
    _S("backend_kind", str, "auto", _C, "the engine's dialect: sglang (miles' wire, the embedded backend's), vllm "
       "(its completions API with token ids), or auto (ask the engine at start-up)",
       choices=("sglang", "vllm", "auto")),
    _S("tool_call_parser", str, "hermes", _C, "how tool calls are read from the text of an engine that answers "
       "text (vllm): hermes (`<tool_call>` JSON blocks: Qwen and Hermes templates) or none",
       choices=("hermes", "none")),
    _S("session_mode", str, "v1", _C, "new sessions' semantics (miles' --use-session-server): v1 a line with one-step "
       "rollback, v2 a tree (every request attaches at its deepest matching node; retries become siblings); "
       "a session keeps the mode it was created with", choices=("v1", "v2")),
    _S("tokenizer", str, None, _C, "dir with tokenizer.json + chat template (unset: the byte tokenizer)"),
    _S("connect_timeout", float, 5.0, _C, "backend connect timeout per turn, seconds", minimum=0),
    _S("read_timeout", float, 600.0, _C, "backend read timeout per turn, seconds", minimum=0),
    _S("pool_maxsize", int, 64, _C, "pooled backend connections per session core (one per concurrent turn)",
       minimum=1),
    _S("turn_wait_timeout", float, None, _C, "seconds a turn waits for the session's previous turn "
       "(unset: connect + read timeouts + 30)", minimum=0),
    _S("routing_replay_layers", int, 0, _C, "routing replay (R3): the model's MoE layer count; above 0 every "
       "turn asks the backend for routed_experts, and /samples shapes them into rows of this many layers "
       "(0: off; with the embedded backend it follows --reference-r3-layers)", minimum=0),
    _S("indexer_replay", bool, False, _C, "indexer replay: ask the backend for indexer_topk"),
    _S("max_message_bytes", int, 8 << 20, _C, "413 for a message whose text is over this many UTF-8 bytes",
       minimum=1),
    _S("max_prompt_tokens", int, 1 << 20, _C, "413 for a turn whose prompt is over this many tokens", minimum=1),
    _S("max_sessions", int, 10_000, _C, "429 for a new session past this many on the server (every "
       "worker's, counted in the data directory)", minimum=1),
    _S("session_idle_ttl", float, 86_400.0, _C, "seconds after which a session nobody used is deleted",
       minimum=0),
    _S("tombstone_ttl", float, 3600.0, _C, "seconds a deleted or expired session's id answers 410 Gone "
       "instead of 404 (its tombstone, kept in the data directory; 0: none)", minimum=0),
    _S("max_tombstones", int, 4096, _C, "tombstones kept per session worker, the oldest dropped first "
       "(0: none)", minimum=0),
    _S("data_dir", str, None, _C, "the sessions' journals live here and survive restarts (unset: "
       "$XDG_STATE_HOME/shinken/session-server/HOST-PORT, see docs/session-server-ops.md)"),
    _S("fsync", bool, False, _C, "fsync each journal append before the reply: a machine crash then loses "
       "no answered turn either (off: a process crash loses none; each turn waits for the disk)"),
    _S("max_session_bytes", int, 8 << 30, _C, "507 for a turn that would grow one session's journal past this "
       "many bytes (every turn stores its whole request)", minimum=1),
    _S("max_data_bytes", int, None, _C, "507 for a turn or session that would grow all the server's journals "
       "past this many bytes (unset: the disk is the bound)", minimum=1),
    _S("max_inflight_bytes", int, 1 << 30, _C, "503 with Retry-After for a request body that would take the "
       "bytes of request bodies being handled past this, per server process and per session worker",
       minimum=1),
    _S("session_sample_picker_path", str, "drop_retries", _C, "tree sessions' /samples picker, fn(leaf_samples, "
       "session_metadata) -> a subset of them: a name of webapp.tree_samples.PICKERS or an import path "
       "package.module:function (miles' own paths of its defaults select ours)", pattern=_HOOK_SELECTOR),
    _S("session_sample_postprocessor_path", str, "default_postprocess", _C, "tree sessions' /samples "
       "post-processor, fn(picked_samples, session_metadata) -> samples: a name of "
       "webapp.tree_samples.POSTPROCESSORS or an import path package.module:function", pattern=_HOOK_SELECTOR),
    _S("session_message_matcher", str, "strict", _C, "when a replayed message is the stored one (miles' "
       "--session-message-matcher), for v1's append check and v2's positioning: strict, loose_tool_call "
       "(tool-call arguments may be any spelling of the same JSON object), role_content_only (high risk: "
       "only role and content compared), or an import path package.module:function", pattern=_HOOK_SELECTOR),
    _S("max_image_bytes", int, 16 << 20, _C, "400 for an image over this many (decoded) bytes", minimum=1),
    _S("max_images", int, 1024, _C, "400 for a request with more images than this", minimum=0),
    # -- router: router mode only ----------------------------------------------------------------
    _S("api_key", str, None, _R, "require 'Authorization: Bearer KEY' on all routes but /health (the flag "
       "shows the key in ps: prefer --api-key-file or the environment variable)"),
    _S("control_timeout", float, 30.0, _R, "deadline of a create/get/delete on a worker, seconds", minimum=0),
    _S("chat_margin", float, 60.0, _R, "a chat's deadline is connect + read timeouts + this, seconds",
       minimum=0),
    _S("health_timeout", float, 2.0, _R, "/health asks every worker with this deadline, seconds", minimum=0),
    _S("chunk_timeout", float, 60.0, _R, "a streamed body chunk must reach a worker within this, seconds",
       minimum=0),
    _S("startup_timeout", float, 60.0, _R, "a session worker's spawn to first heartbeat (tokenizer loading "
       "included), seconds", minimum=0),
    _S("heartbeat_interval", float, 1.0, _R, "seconds between heartbeats to a session worker", minimum=0),
    _S("heartbeat_timeout", float, 10.0, _R, "seconds a session worker may miss heartbeats (with no CPU "
       "progress) before it is restarted", minimum=0),
    _S("busy_timeout", float, 600.0, _R, "seconds a session worker may miss heartbeats while using CPU "
       "before it is restarted", minimum=0),
    _S("boot_attempts", int, 3, _R, "a shard whose worker fails to boot this many times in a row is marked "
       "failed (reason in /health) instead of respawned", minimum=1),
    _S("instance", str, None, _R, "instance tag minted into session ids, for several servers behind nginx "
       "(shinken-session-server nginx-config; docs/scale-out.md)", pattern=r"[a-z0-9]{1,16}"),
    _S("records_get_pace", float, 512.0, _R, "MiB/s that the records GETs a server process sends keep to, "
       "together, while it serves other requests (chats): a multi-GiB GET then leaves the chats their CPU; "
       "with nothing else in flight a GET runs flat out (0: never paced; both server modes; "
       "docs/session-server-ops.md)", minimum=0),
    # -- http: the HTTP front (both modes) -------------------------------------------------------
    _S("body_timeout", float, 300.0, _H, "408 for a request body not received within this many seconds",
       minimum=0),
    _S("max_client_connections", int, 256, _H, "429 for a connection past this many open ones from one "
       "client address", minimum=1),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
assert len(BY_NAME) == len(SETTINGS), "a setting is declared twice"


def default(name: str) -> Any:
    """The table's default of setting ``name`` (config dataclasses declare their fields with it)."""
    return BY_NAME[name].default


def values_from_env(environ: Mapping[str, str] | None = None,
                    scopes: Iterable[Scope] = tuple(Scope)) -> dict[str, Any]:
    """The settings of ``scopes`` that ``SHINKEN_<NAME>`` sets, parsed, by name.

    Raises ``ValueError`` naming the variable when one does not parse.
    """
    env = os.environ if environ is None else environ
    wanted = frozenset(scopes)
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        key = setting.env_var
        if setting.scope in wanted and key is not None and key in env:
            try:
                values[setting.name] = setting.parse(env[key])
            except ValueError as exc:
                raise ValueError(f"{key} {exc}") from None
    return values


def scope_values(scope: Scope, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every setting of ``scope``: ``given`` where it has one, else the table's default."""
    given = given or {}
    return {s.name: given.get(s.name, s.default) for s in SETTINGS if s.scope is scope}


def embedded_replay_layers(given: Mapping[str, Any]) -> int:
    """Routing replay with the embedded reference backend: as set, else its R3 layers, so the
    embedded setup exercises the routed-expert path end to end (in both server modes)."""
    if given.get("routing_replay_layers") is not None:
        return int(given["routing_replay_layers"])
    layers = given.get("reference_r3_layers")
    return int(default("reference_r3_layers") if layers is None else layers)


# -- the launcher --------------------------------------------------------------------------------

def _arg_type(setting: Setting) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return setting.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None  # argparse names the flag

    convert.__name__ = setting.name  # argparse names the converter in some messages
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per setting with a flag. Every default is None ("not given"): the launcher
    then takes ``SHINKEN_<NAME>`` or the table's default (:func:`launcher_env`), and the help
    shows both."""
    for s in SETTINGS:
        if s.flag is None:
            continue
        shown = "unset" if s.default is None else s.default
        help_text = f"{s.doc} (default: {shown}; env {s.env_var}; scope {s.scope.value})"
        if s.kind is bool:
            parser.add_argument(s.flag, action="store_true", default=None, help=help_text)
        else:
            parser.add_argument(s.flag, type=_arg_type(s), default=None, metavar=s.name.upper(), help=help_text)


def given_values(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings given to the launcher: its flag where given, else ``SHINKEN_<NAME>`` where
    set. Raises ``ValueError`` naming a variable that does not parse."""
    flags = {s.name: getattr(args, s.name) for s in SETTINGS if getattr(args, s.name, None) is not None}
    return {**values_from_env(environ), **flags}


def defaults() -> dict[str, Any]:
    """Every setting's default, by name."""
    return {s.name: s.default for s in SETTINGS}


def launcher_env(values: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the launched server reads its settings from: ``environ`` with
    ``SHINKEN_<NAME>`` set for every setting that has a value (None: left unset)."""
    env = dict(os.environ if environ is None else environ)
    for s in SETTINGS:
        key = s.env_var
        if key is None:
            continue
        value = values.get(s.name)
        if value is None:
            env.pop(key, None)
        else:
            env[key] = ("1" if value else "0") if s.kind is bool else str(value)
    return env


def parse_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6HOST]:PORT`` or ``:PORT`` (host 127.0.0.1) -> ``(host, port)``.

    Raises ``argparse.ArgumentTypeError`` (both users are ``--bind`` options) for anything else.
    """
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"--bind must be HOST:PORT, got {bind!r}")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise argparse.ArgumentTypeError(f"--bind: an IPv6 host goes in brackets ([::1]:PORT), got {bind!r}")
    return host.strip("[]") or DEFAULT_HOST, int(port)


# -- docs ----------------------------------------------------------------------------------------

def docs_table() -> str:
    """The Markdown table of every setting (``docs/session-server-ops.md`` holds this text)."""
    rows = ["| setting | flag | environment | type | default | scope | what |",
            "|---|---|---|---|---|---|---|"]
    for s in SETTINGS:
        shown = "unset" if s.default is None else s.default
        rows.append(f"| `{s.name}` | {f'`{s.flag}`' if s.flag else '-'} | "
                    f"{f'`{s.env_var}`' if s.env_var else '-'} | {s.kind.__name__} | {shown} | "
                    f"{s.scope.value} | {s.doc} |")
    return "\n".join(rows) + "\n"
