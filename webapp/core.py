"""The session core: sessions, TITO turns and records, answered as transport-independent ``Reply``.

Every adapter (the single-process Flask app, the data-plane worker) builds the core with
``build_session_core`` and turns each ``Reply`` into its own transport, so the modes cannot
drift. Concurrency: ``chat`` runs in many greenlets or threads at once. Each session has a
*turn lock* (serializes its turns, held across the backend call, never shared between
sessions) and a *state lock* (held only to swap the committed state or snapshot it), so a
records GET never waits for a turn in flight and no lock serializes two sessions.

The engine is reached through its dialect (``webapp.engines``): it builds the engine request
from the turn and maps the reply to the turn's pieces; this module names no engine field.

Each committed record is miles' ``SessionRecord`` (``timestamp``, ``request_timestamp``,
``method``, ``path``, ``request`` and ``response`` as the dialect gives them — for SGLang the
body sent and the reply verbatim, R3 included; for any engine miles' shape —, ``status_code``;
plus ``rollback``), serialized once and
appended to the session's journal (``webapp.journal``) before the reply goes out; the worker
keeps only what the next turn needs (the TITO state) and, per record, a small
:class:`webapp.samples.TurnRecord` (token counts, output ids, logprobs, where its bytes are),
so memory does not grow with reply sizes. A records GET is a list of file spans between small
JSON pieces (``webapp.filebody``): never loaded, re-encoded or joined. A session whose journal
cannot be written gets 507 and keeps its state (nothing of the turn is stored anywhere).

Images (``webapp.images``): each image part is checked, hashed and decoded once per session
(the session keeps each image once, by sha256, at commit); the dialect sends them in its
engine's form and records each as its reference ``sha256:<hex>`` (``webapp.engines.sglang``).
``GET /sessions/{id}?images=1`` adds ``"images": {sha256: {mime_type, width, height, data}}``.

Errors answer ``{"error": "<text>"}`` on the session-management routes (miles' shape) and
OpenAI's ``{"error": {"message", "type", "code"}}`` on the OpenAI routes (chat, and the
proxy under ``v1/``): see ``webapp.session_errors`` and ``webapp.routes``.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

import requests

from webapp import anthropic
from webapp.backend import BackendClient
from webapp.datadir import default_data_dir, instance_id
from webapp.engines import Dialect, EngineTurn, ReplayRequest, dialect_for
from webapp.engines.probe import EngineCheckFailed, identify_engine
from webapp.errors import WebappError
from webapp.filebody import Piece, read_pieces
from webapp.images import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGES,
    DecodedImage,
    ImageLimits,
    extract_images,
)
from webapp.journal import JournalStore, RestoredSession, SessionJournal, StoredImage
from webapp.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_IDLE_TTL,
    RequestLimits,
    SessionExpiry,
    URLBytes,
    loads_strict,
    loads_strict_urls,
)
from webapp.matchers import DEFAULT_MATCHER, resolve_matcher
from webapp.records import IdsText, RecordParts, Rows
from webapp.request_fields import check_request_fields
from webapp.routes import GENERATION_HEADER, PROXY_HEADERS, anthropic_error_body, openai_error_body
from webapp.samples import TurnRecord, assemble_samples, encode_samples
from webapp.session_errors import (
    BodyTooLarge,
    GenerationMismatch,
    InvalidField,
    InvalidJSON,
    RenderSettingsChanged,
    SessionBusy,
    SessionError,
    SessionExists,
    SessionGone,
    SessionNotFound,
    TruncatedGeneration,
    UpstreamStatus,
)
from webapp.settings import MAX_BODY_BYTES, default
from webapp.sharding import shard_for
from webapp.tito import (
    INITIAL_STATE,
    MAX_TRIM_TOKENS,
    TitoState,
    TurnPlan,
    commit_turn,
    normalize_messages,
    plan_turn,
    session_mismatch,
)
from webapp.tokenizers import ChatTokenizer, load_tokenizer
from webapp.tombstones import Tombstones
from webapp.tree import Matcher, SessionTree, TreeNode
from webapp.tree_samples import SampleHooks, collect_tree_samples, encode_tree_samples

__all__ = [
    "MAX_CHAT_BODY_BYTES",
    "SESSION_ID_PATTERN",
    "CoreConfig",
    "Reply",
    "Session",
    "SessionCore",
    "SessionRegistry",
    "anthropic_error_response",
    "build_session_core",
    "error_reply",
    "error_response",
    "json_response",
    "openai_error_response",
]

log = logging.getLogger(__name__)

MAX_CHAT_BODY_BYTES = MAX_BODY_BYTES  # webapp.settings: the one body cap of every HTTP entry
TURN_WAIT_MARGIN = 30.0  # see CoreConfig.turn_wait
SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")
CHAT_PATH = "/v1/chat/completions"
SAMPLES_CONTENT_TYPE = "application/octet-stream"
SSE_CONTENT_TYPE = "text/event-stream"


@dataclass
class Reply:
    """One HTTP answer. A list body is the pieces of one body, to be sent without joining:
    ``bytes``, or a :class:`webapp.filebody.FileSpan` of a journal (a records GET)."""

    status: int
    body: bytes | list[Piece]
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def chunks(self) -> list[Piece]:
        return self.body if isinstance(self.body, list) else [self.body]

    @property
    def content_length(self) -> int:
        return sum(len(c) for c in self.chunks)

    def read(self) -> bytes:
        """The whole body in memory, file spans read (tests, small bodies)."""
        return read_pieces(self.chunks)


def json_response(status: int, obj: Any) -> Reply:
    return Reply(status, json.dumps(obj, separators=(",", ":")).encode())


def error_response(status: int, message: str) -> Reply:
    """The error shape of the session-management routes (miles'): ``{"error": "<message>"}``."""
    return json_response(status, {"error": message})


def openai_error_response(status: int, message: str, type_: str, code: str) -> Reply:
    """The error shape of the OpenAI routes: ``{"error": {"message", "type", "code"}}``."""
    return json_response(status, openai_error_body(message, type_, code))


def anthropic_error_response(status: int, message: str) -> Reply:
    """The error shape of the Messages route: ``{"type": "error", "error": {"type", "message"}}``."""
    return json_response(status, anthropic_error_body(status, message))


def error_reply(exc: SessionError, *, openai: bool = False) -> Reply:
    """``exc`` as the reply every adapter sends; ``openai``: the route is an OpenAI one."""
    if isinstance(exc, UpstreamStatus):
        return Reply(exc.status, exc.body, exc.content_type)
    if openai:
        return openai_error_response(exc.status, str(exc), exc.openai_type, exc.code)
    return error_response(exc.status, str(exc))


@dataclass
class CoreConfig:
    """The ``core`` settings of :data:`webapp.settings.SETTINGS` (defaults and docs there)."""

    backend_url: str
    tokenizer: str | None = default("tokenizer")  # None: the byte tokenizer
    connect_timeout: float = default("connect_timeout")
    read_timeout: float = default("read_timeout")
    pool_maxsize: int = default("pool_maxsize")
    turn_wait_timeout: float | None = default("turn_wait_timeout")  # None: see turn_wait()
    # Routing replay (miles' --use-rollout-routing-replay): > 0 asks the backend for R3
    # (through the dialect: ReplayRequest) and is the model's layer count /samples shapes it with.
    routing_replay_layers: int = default("routing_replay_layers")
    indexer_replay: bool = default("indexer_replay")  # miles' --use-rollout-indexer-replay
    # The engine's dialect (webapp.engines): "auto" asks the engine at build time (webapp.engines.probe).
    backend_kind: str = default("backend_kind")
    tool_call_parser: str = default("tool_call_parser")  # for engines that answer text (vllm)
    session_mode: str = default("session_mode")  # new sessions: "v1" line, "v2" tree (miles' v2)
    # Work and session bounds; see webapp.limits.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    max_sessions: int = DEFAULT_MAX_SESSIONS
    session_idle_ttl: float = DEFAULT_SESSION_IDLE_TTL
    tombstone_ttl: float = default("tombstone_ttl")  # a gone session's 410 (webapp.tombstones)
    max_tombstones: int = default("max_tombstones")
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # one image's decoded bytes (webapp.images)
    max_images: int = DEFAULT_MAX_IMAGES  # images in one request
    data_dir: str | None = default("data_dir")  # None: webapp.datadir.default_data_dir()
    fsync: bool = default("fsync")  # each journal append durable before the reply
    max_session_bytes: int = default("max_session_bytes")  # one session's journal (webapp.journal)
    max_data_bytes: int | None = default("max_data_bytes")  # all the data directory's journals
    max_inflight_bytes: int = default("max_inflight_bytes")  # request bodies being handled (webapp.inflight)
    # Tree sessions' /samples hooks: selectors of webapp.tree_samples (resolved by build_session_core).
    session_sample_picker_path: str = default("session_sample_picker_path")
    session_sample_postprocessor_path: str = default("session_sample_postprocessor_path")
    # When a replayed message is the stored one: a selector of webapp.matchers (resolved by build_session_core).
    session_message_matcher: str = default("session_message_matcher")

    def turn_wait(self) -> float:
        """How long a turn waits for its session's previous one: as set, else that turn's whole
        backend budget plus a margin (so a waiting turn outlasts the one it waits for)."""
        if self.turn_wait_timeout is not None:
            return self.turn_wait_timeout
        return self.connect_timeout + self.read_timeout + TURN_WAIT_MARGIN


@dataclass(eq=False)
class Session:
    session_id: str
    journal: SessionJournal
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)  # for the idle expiry
    turn_lock: threading.Lock = field(default_factory=threading.Lock)
    state_lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    state: TitoState = INITIAL_STATE
    previous: TitoState | None = None
    records: list[TurnRecord] = field(default_factory=list)  # one per checkpoint of ``state``, bytes on disk
    rollbacks: int = 0
    images: dict[str, StoredImage] = field(default_factory=dict)  # by sha256, each once (content-addressed)
    # webapp.images.url_key of each image part's data URL committed -> its sha256 (in memory
    # only: after a restart an image is decoded once more, then known by its text again)
    image_urls: dict[bytes, str] = field(default_factory=dict)
    # (state, metadata, its JSON) of the last GET/samples: the mismatch check renders the session.
    metadata_cache: tuple[TitoState, dict[str, Any], bytes] | None = None
    ids_cache: tuple[TitoState, IdsText] | None = None  # the text of the state's token ids (records GET)
    # A tree session (miles' v2): the forest and its active node (the last committed); ``state``
    # and ``records`` are then the active path's, so a GET serves it as it serves a line.
    tree: SessionTree | None = None
    active: TreeNode | None = None
    inflight: int = 0  # tree turns between positioning and commit (they hold no turn lock)
    # The session's generation: the turns committed to it since it was created (a line's
    # rollback turns included, a tree's every node), X-Miles-Session-Generation on its replies.
    generation: int = 0
    # The first committed turn's chat_template_kwargs (canonical JSON; None: no turn yet, or
    # not read back from the journal yet after a restart): every later turn must send the same.
    render_pin: str | None = None

    def ids_text(self, state: TitoState) -> IdsText:
        """The JSON text of ``state``'s token ids: every record's prompt ids are a prefix of it."""
        cached = self.ids_cache
        if cached is None or cached[0] is not state:
            cached = self.ids_cache = (state, IdsText(state.token_ids))
        return cached[1]

    @classmethod
    def restored(cls, r: RestoredSession) -> Session:
        generation = len(r.tree) if r.tree is not None else len(r.records) + r.rollbacks
        return cls(r.session_id, r.journal, created_at=r.created_at, state=r.state, previous=r.previous,
                   records=r.records, rollbacks=r.rollbacks, images=r.images, tree=r.tree, active=r.active,
                   generation=generation)

    def commit(self, new_state: TitoState, plan: TurnPlan, turn: TurnRecord, record: RecordParts,
               images: dict[str, DecodedImage] | None = None,
               image_urls: Mapping[bytes, str] | None = None, render: str | None = None,
               prompt_text: bytes | None = None) -> int:
        """Store a finished turn, journal first; the session's generation after it, 0 (nothing
        stored) if the session was closed meanwhile. Raises ``InsufficientStorage`` (nothing
        stored) if the journal cannot be written. ``render``: the turn's render pin (see
        :meth:`pin_render`); ``prompt_text``: the prompt ids' text the engine request was
        built around (``SessionJournal.append_turn``).

        A rollback turn replaces the rolled-back record, as miles truncates its records: the
        records always match the checkpoints of the current state (the rolled-back history
        is dropped; ``metadata.num_rollbacks`` counts it; the journal keeps it, append-only).
        """
        with self.state_lock:  # a GET snapshots before or after the append, never during it
            if self.closed:
                return 0
            self.pin_render(render)
            # The record whose state the turn builds on: the journal stores what this one adds.
            base = (self.records[-2] if len(self.records) > 1 else None) if plan.rollback \
                else (self.records[-1] if self.records else None)
            turn, stored = self.journal.append_turn(plan.base, new_state, plan.rollback, turn, record,
                                                    base.record if base is not None else None,
                                                    list((images or {}).values()), prompt_text=prompt_text)
            self.previous, self.state = plan.base, new_state
            if plan.rollback:
                self.records = self.records[:-1]
                self.rollbacks += 1
            self.records.append(turn)
            self.images.update(stored)
            self.image_urls.update(image_urls or {})  # every image of the turn is held now
            self.generation += 1
            return self.generation

    def commit_node(self, parent: TreeNode | None, new_state: TitoState, plan: TurnPlan, turn: TurnRecord,
                    record: RecordParts, response_id: str, images: dict[str, DecodedImage] | None = None,
                    image_urls: Mapping[bytes, str] | None = None, render: str | None = None,
                    prompt_text: bytes | None = None) -> int:
        """A tree session's :meth:`commit`: the generation becomes a new node under ``parent``
        (the attach point found when it was positioned, so concurrent generations from one
        spot become siblings) and the active node. Journal first, stored on the parent's
        record; the generation after it, 0 if the session was closed meanwhile; ``TreeFull``
        if concurrent turns took the last places meanwhile, ``RenderSettingsChanged`` if a
        concurrent first turn pinned other settings (nothing stored)."""
        assert self.tree is not None, "a tree session"
        with self.state_lock:
            if self.closed:
                return 0
            self.tree.check_room()
            self.pin_render(render)
            turn, stored = self.journal.append_turn(
                plan.base, new_state, False, turn, record, parent.turn.record if parent is not None else None,
                list((images or {}).values()),
                node={"parent": parent.seq if parent is not None else None, "response_id": response_id},
                prompt_text=prompt_text)
            node = self.tree.add(parent, new_state, turn, response_id=response_id, committed_at=turn.timestamp)
            self.active, self.state = node, new_state
            self.records = [n.turn for n in node.path()]
            self.images.update(stored)
            self.image_urls.update(image_urls or {})
            self.generation += 1
            return self.generation

    def pin_render(self, render: str | None) -> None:
        """Under the state lock, at commit: the first turn pins ``render``; a later one must
        match it (checked before the engine call too; this catches concurrent first turns)."""
        if render is None:
            return
        if self.render_pin is None and not self.generation:
            self.render_pin = render
        elif self.render_pin is not None and self.render_pin != render:
            raise RenderSettingsChanged(json.loads(self.render_pin), json.loads(render))

    def snapshot(self) -> tuple[list[TurnRecord], TitoState, int, str]:
        """(records, state, rollbacks, journal version): the version names this session's state."""
        with self.state_lock:
            return list(self.records), self.state, self.rollbacks, self.journal.version


class SessionRegistry:
    """Live sessions by id, each with its journal in ``store``. A deleted session leaves at
    once (its file too), its id to ``tombstones``, so it answers 410 while a turn finishes."""

    def __init__(self, store: JournalStore, tombstones: Tombstones | None = None) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self.store = store
        # in memory until the core opens the shard's file (SessionCore.restore_shard)
        self.tombstones = tombstones if tombstones is not None else Tombstones(default("tombstone_ttl"),
                                                                               default("max_tombstones"))

    def missing(self, session_id: str) -> SessionError:
        """The error of an id with no live session: 410 while its tombstone lasts, else 404."""
        stone = self.tombstones.get(session_id)
        return SessionGone(session_id, stone.reason) if stone is not None else SessionNotFound(session_id)

    def restore(self, owns: Callable[[str], bool], pause: Callable[[], object] = lambda: None) -> int:
        """Load the sessions on disk that ``owns`` accepts (this worker's shard); how many.
        ``pause``: see ``JournalStore.restore``."""
        n = 0
        # A session whose journal is set aside whole answers 410 (reason ``damaged``), not 404.
        for restored in self.store.restore(owns, pause, lambda session_id: self.tombstones.add(session_id, "damaged")):
            with self._lock:
                self._sessions[restored.session_id] = Session.restored(restored)
            n += 1
        return n

    def create_session(self, session_id: str | None = None, admit: Callable[[int], None] | None = None,
                       mode: str = "v1") -> Session:
        """``admit(sessions_on_disk)`` may refuse (raise) before a session is added; the count
        is the whole server's (every shard's journals), taken under the store's create lock.
        ``mode``: ``v2`` a tree session (fixed for its life: its journal says so)."""
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif not isinstance(session_id, str) or not SESSION_ID_PATTERN.fullmatch(session_id):
            raise InvalidField("session_id", f"must match {SESSION_ID_PATTERN.pattern}")
        with self._lock:
            if session_id in self._sessions:
                raise SessionExists(session_id)
            created_at = time.time()
            journal = self.store.create(session_id, created_at, admit, mode)
            session = self._sessions[session_id] = Session(session_id, journal, created_at=created_at,
                                                           tree=SessionTree() if mode == "v2" else None)
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise self.missing(session_id)
        session.last_used = time.monotonic()
        return session

    def peek(self, session_id: str) -> Session:
        """The session, without counting as use: looking at it (the viewer) never delays its expiry."""
        session = self._sessions.get(session_id)
        if session is None:
            raise self.missing(session_id)
        return session

    def ids(self) -> list[str]:
        return list(self._sessions)

    def idle_since(self) -> list[tuple[str, float]]:
        """``(session_id, last_used)`` of every session without a turn in flight."""
        return [(sid, s.last_used) for sid, s in list(self._sessions.items())
                if not (s.turn_lock.locked() or s.inflight)]

    def remove(self, session_id: str, reason: str = "deleted",
               precondition: Callable[[Session], None] | None = None) -> Session:
        """Delete the session (``reason``: ``deleted`` or ``expired``, its tombstone's), after
        ``precondition(session)`` (may raise: then nothing changes), both after a commit in
        flight, so the precondition sees it and its append is removed too."""
        session = self._sessions.get(session_id)
        if session is None:
            raise self.missing(session_id)
        with session.state_lock:
            with self._lock:
                if self._sessions.get(session_id) is not session:  # removed meanwhile
                    raise self.missing(session_id)
                if precondition is not None:
                    precondition(session)
                del self._sessions[session_id]
            # The tombstone before the journal goes: a worker killed between the two leaves a
            # live session, never an id that 404s; before ``closed``, so a turn that sees it 410s.
            self.tombstones.add(session_id, reason)
            session.closed = True
            self.store.remove(session.journal)
        return session

    def __len__(self) -> int:
        return len(self._sessions)


def _parse_chat_body(body: bytes | memoryview) -> tuple[dict[str, Any], URLBytes]:
    """The checked request, and its data URLs as views of ``body`` (for this turn only)."""
    if len(body) > MAX_CHAT_BODY_BYTES:
        raise BodyTooLarge(f"request body over {MAX_CHAT_BODY_BYTES} bytes")
    request, url_bytes = loads_strict_urls(body)
    if not isinstance(request, dict):
        raise InvalidJSON("invalid JSON body: expected an object")
    check_request_fields(request)  # unknown and refused fields: 400 naming them
    if not isinstance(request.get("stream", False), bool):
        raise InvalidField("stream", "expected a boolean")
    n = request.get("n")
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise InvalidField("n", "only n=1 is supported: one reply is committed per turn")
    for name in ("max_tokens", "max_completion_tokens"):
        value = request.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InvalidField(name, "expected a positive integer")
    for name in ("temperature", "top_p"):
        value = request.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise InvalidField(name, "expected a number")
    if request.get("model") is not None and not isinstance(request["model"], str):
        raise InvalidField("model", "expected a string")
    return request, url_bytes


def _token_logprob(tokenizer: ChatTokenizer, token_id: Any, logprob: Any) -> dict[str, Any]:
    try:
        text = tokenizer.decode([token_id])
        raw: list[int] | None = list(text.encode("utf-8", "surrogatepass"))
    except (UnicodeDecodeError, TypeError, ValueError, OverflowError):
        text, raw = "", None  # part of a multi-byte character: no text of its own
    return {"token": text, "logprob": logprob, "bytes": raw}


def _openai_logprobs(tokenizer: ChatTokenizer, turn: EngineTurn) -> dict[str, Any]:
    """OpenAI's ``choices[i].logprobs`` from the turn's output ids, logprobs and (when the engine
    gave them) top alternatives."""
    content = []
    for i, (token_id, logprob) in enumerate(zip(turn.output_ids, turn.logprobs)):
        entry = _token_logprob(tokenizer, token_id, logprob)
        alternatives = turn.top_logprobs[i] if turn.top_logprobs is not None and i < len(turn.top_logprobs) else []
        entry["top_logprobs"] = [_token_logprob(tokenizer, alt_id, alt_lp) for alt_lp, alt_id in alternatives]
        content.append(entry)
    return {"content": content, "refusal": None}


def _sse_chunks(completion: dict[str, Any], include_usage: bool) -> list[Piece]:
    """A whole completion as OpenAI stream events: role+content, finish, [usage], [DONE]."""
    base = {"id": completion.get("id", ""), "object": "chat.completion.chunk",
            "created": completion.get("created", int(time.time())), "model": completion.get("model", "")}
    events = []
    for choice in completion.get("choices") or ():
        message = choice.get("message") or {}
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        index = choice.get("index", 0)
        events.append({**base, "choices": [{"index": index, "delta": delta, "logprobs": choice.get("logprobs"),
                                            "finish_reason": None}]})
        events.append({**base, "choices": [{"index": index, "delta": {},
                                            "finish_reason": choice.get("finish_reason")}]})
    if include_usage:
        events.append({**base, "choices": [], "usage": completion.get("usage")})
    out: list[Piece] = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events]
    out.append(b"data: [DONE]\n\n")
    return out


class SessionCore:
    """The operations of the session server; each returns a ``Reply`` and never raises for a
    client, backend or session error (those become error replies)."""

    def __init__(self, tokenizer: ChatTokenizer, backend: BackendClient, *,
                 registry: SessionRegistry | None = None, turn_wait_timeout: float | None = None,
                 routing_replay_layers: int = 0, indexer_replay: bool = False,
                 limits: RequestLimits | None = None, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 session_idle_ttl: float = DEFAULT_SESSION_IDLE_TTL,
                 image_limits: ImageLimits | None = None, dialect: Dialect | None = None,
                 session_mode: str = "v1", matcher: Matcher | None = None,
                 sample_hooks: SampleHooks | None = None, tombstone_ttl: float = default("tombstone_ttl"),
                 max_tombstones: int = default("max_tombstones")) -> None:
        """``registry``: None is one over a private temporary directory, deleted by
        :meth:`close` (tests, embedding); a server passes its data directory's. ``dialect``: the
        engine's (:mod:`webapp.engines`); None is the ``sglang`` one with the replay asked here.
        ``session_mode``: new sessions' (``v2``: trees); ``matcher``: when a request's message is
        the stored one, for a line session's append check (``webapp.tito.plan_turn``) and a tree
        session's positioning (``webapp.tree``); None: miles' ``strict`` (``webapp.matchers``). ``sample_hooks``: tree sessions'
        /samples picker and post-processor (None: miles' defaults)."""
        self.tokenizer = tokenizer
        self.backend = backend
        self.session_mode = session_mode
        self.matcher = matcher if matcher is not None else resolve_matcher(DEFAULT_MATCHER)
        self._private_dir = None
        if registry is None:
            self._private_dir = tempfile.mkdtemp(prefix="shinken-sessions-")
            registry = SessionRegistry(JournalStore(self._private_dir))
        self.registry = registry
        self.tombstone_ttl, self.max_tombstones = tombstone_ttl, max_tombstones
        registry.tombstones = Tombstones(tombstone_ttl, max_tombstones)  # the shard's file: restore_shard
        self.limits = limits if limits is not None else RequestLimits()
        self.image_limits = image_limits if image_limits is not None else ImageLimits()
        self.expiry = SessionExpiry(max_sessions, session_idle_ttl, self.registry.idle_since,
                                    lambda session_id: self.registry.remove(session_id, reason="expired"))
        # None: CoreConfig's rule over the default timeouts (one rule, not a second default);
        # build_session_core passes the configured one.
        self.turn_wait_timeout = turn_wait_timeout if turn_wait_timeout is not None else CoreConfig("").turn_wait()
        self.routing_replay_layers = routing_replay_layers
        self.sample_hooks = sample_hooks if sample_hooks is not None else SampleHooks()
        # tree node -> its leaf's tito_session_mismatch; weak: a deleted session's nodes go
        self._leaf_mismatches: weakref.WeakKeyDictionary[TreeNode, list[dict[str, Any]] | None] = \
            weakref.WeakKeyDictionary()
        self.dialect = dialect if dialect is not None else dialect_for(
            "sglang", ReplayRequest(routed_experts=routing_replay_layers > 0, indexer_topk=indexer_replay))
        # miles' session_server_instance_id: the data directory's, so it changes exactly when
        # the sessions a client holds are gone (another directory), not on a restart.
        self.instance_id = instance_id(registry.store.data_dir)

    def create_session(self, session_id: str | None = None) -> Reply:
        self.expiry.sweep()
        try:
            session = self.registry.create_session(session_id, admit=self.expiry.admit, mode=self.session_mode)
        except SessionError as exc:
            return error_reply(exc)
        return json_response(200, {"session_id": session.session_id})

    def _snapshot(self, session: Session) -> tuple[list[TurnRecord], TitoState, dict[str, Any], bytes, str, int]:
        """A consistent snapshot of the session: its records, state and miles' session metadata
        (``tito_session_mismatch`` when computable, ``accumulated_token_ids``,
        ``max_trim_tokens``, plus our counters), also as JSON bytes, its journal's version and
        its generation.
        Computed once per committed turn: every commit makes a new state, the cache key."""
        tree: dict[str, Any] | None = None
        if session.tree is None:
            records, state, rollbacks, version = session.snapshot()
            generation = len(records) + rollbacks  # the snapshot's own (Session.generation's rule)
        else:  # the active path and the forest as one commit left them (metadata.tree)
            with session.state_lock:
                records, state, rollbacks, version = list(session.records), session.state, 0, session.journal.version
                generation = session.generation
                cached = session.metadata_cache
                if cached is None or cached[0] is not state:
                    tree = session.tree.metadata()
        cached = session.metadata_cache
        if cached is not None and cached[0] is state:
            return records, state, cached[1], cached[2], version, generation
        metadata: dict[str, Any] = {}
        try:
            mismatch = session_mismatch(state, self.tokenizer)
        except Exception:  # as miles: a failed check is logged and left out, never fails the GET
            log.exception("tito_session_mismatch of session %s failed", session.session_id)
            mismatch = None
        if mismatch is not None:
            metadata["tito_session_mismatch"] = mismatch
        metadata.update(accumulated_token_ids=list(state.token_ids), max_trim_tokens=MAX_TRIM_TOKENS)
        if tree is not None:
            metadata.update(tree=tree, num_records=len(records))  # a tree has no rollbacks
        else:
            metadata.update(num_records=len(records), num_rollbacks=rollbacks)
        metadata.update(num_messages=len(state.messages), created_at=session.created_at)
        encoded = _metadata_json(metadata, session.ids_text(state).text)
        session.metadata_cache = (state, metadata, encoded)
        return records, state, metadata, encoded, version, generation

    def get_session(self, session_id: str, include_images: bool = False) -> Reply:
        """miles' ``GetSessionResponse``; ``include_images``: plus ``"images"``, every image the
        session's turns sent, once each (by sha256: the references in the records)."""
        self.expiry.sweep()
        try:
            session = self.registry.get(session_id)
        except SessionError as exc:
            return error_reply(exc)
        try:
            session.journal.check_unchanged()  # damaged on disk while running: not served (webapp.journal)
        except SessionError as exc:
            return error_reply(exc)
        records, state, _metadata, encoded, version, generation = self._snapshot(session)
        body: list[Piece] = [json.dumps({"session_id": session_id}, separators=(",", ":"))[:-1].encode()
                             + b',"records":[']
        ids = session.ids_text(state)
        for i, record in enumerate(records):
            assert record.record is not None, "a committed record is in the journal"
            if i:
                body.append(b",")
            body += record.record.pieces(ids.prefix)
        body += (b'],"metadata":', encoded)
        if include_images:
            body += _images_json(session)
        body.append(b"}")
        # Every commit grows the journal by an entry: its size and the last entry's checksum
        # name this version of the body (a Range request resumes only it, ``If-Range``).
        etag = f'"{version}{"-i" if include_images else ""}"'
        return Reply(200, body, headers=(("ETag", etag), (GENERATION_HEADER, str(generation))))

    def samples(self, session_id: str, body: bytes, include_images: bool = False) -> Reply:
        """``POST /sessions/{id}/samples``: the session's training sample(s) as one safetensors
        payload in miles' samples wire format (see ``webapp.samples``); ``include_images``: the
        session's images too, one tensor each."""
        self.expiry.sweep()
        try:
            max_seq_len, agent = _parse_samples_body(body)
            session = self.registry.get(session_id)
            turns, state, metadata, encoded, _version, generation = self._snapshot(session)
            images = _session_images(session) if include_images else None
            if session.tree is not None:
                payload = self._tree_samples(session.tree, encoded, max_seq_len, agent, images)
            else:
                samples, empty_reason = assemble_samples(turns, state.token_ids, self.tokenizer,
                                                         max_seq_len=max_seq_len, max_trim_tokens=MAX_TRIM_TOKENS)
                payload = encode_samples(samples, metadata, empty_reason,
                                         routing_replay_layers=self.routing_replay_layers, images=images)
        except SessionError as exc:
            return error_reply(exc)
        except Exception:
            log.exception("samples of session %s failed", session_id)
            return error_response(500, "internal error in the session core")
        return Reply(200, payload, content_type=SAMPLES_CONTENT_TYPE, headers=((GENERATION_HEADER, str(generation)),))

    def _tree_samples(self, tree: SessionTree, encoded: bytes, max_seq_len: int | None,
                      agent: dict[str, Any] | None, images: list[StoredImage] | None) -> bytes:
        """A tree session's samples (``webapp.tree_samples``): the leaves of the nodes the
        snapshot's ``metadata.tree`` names (commits may go on meanwhile), through this core's
        hooks. The hooks get a copy of the session metadata of their own (decoded from the
        snapshot's JSON: a hook may change it, the cached one stays), the agent's under ``agent``."""
        metadata = json.loads(encoded)
        if agent is not None:
            metadata["agent"] = agent
        samples, empty_reason = collect_tree_samples(tree, self.tokenizer, metadata, max_seq_len=max_seq_len,
                                                     hooks=self.sample_hooks, mismatch=self._leaf_mismatch,
                                                     upto=len(metadata["tree"]["nodes"]))
        return encode_tree_samples(samples, metadata, empty_reason, routing_replay_layers=self.routing_replay_layers,
                                   hooks=self.sample_hooks, images=images)

    def _leaf_mismatch(self, leaf: TreeNode) -> list[dict[str, Any]] | None:
        """A leaf's ``tito_session_mismatch``, computed once per node (a node's state never
        changes; a leaf that gets children keeps its entry until the node goes)."""
        cached: Any = self._leaf_mismatches.get(leaf, self._leaf_mismatches)  # the dict itself: not there
        if cached is not self._leaf_mismatches:
            return cast(list[dict[str, Any]] | None, cached)
        try:
            found = session_mismatch(leaf.state, self.tokenizer)
        except Exception:  # as for a line: a failed check is logged and left out, never fails /samples
            log.exception("tito_session_mismatch of tree node %d failed", leaf.seq)
            found = None
        self._leaf_mismatches[leaf] = found
        return found

    def proxy(self, session_id: str, method: str, path: str, query: str, body: bytes,
              headers: dict[str, str]) -> Reply:
        """The catch-all ``/sessions/{id}/{path}``: forwarded to ``<backend>/{path}`` (e.g.
        ``v1/models``) with the backend's status, content type and body relayed untouched."""
        self.expiry.sweep()
        try:
            self.registry.get(session_id)
            wanted = {k: v for k, v in headers.items() if k.lower() in PROXY_HEADERS}
            reply = self.backend.proxy(method, path, query, body, wanted, routing_key=session_id)
        except SessionError as exc:
            return error_reply(exc, openai=path.startswith("v1/"))
        except Exception:  # as in chat: one bad call must not take the worker down
            log.exception("proxy %s %s of session %s failed", method, path, session_id)
            return error_response(500, "internal error in the session core")
        return Reply(reply.status, reply.body, content_type=reply.content_type)

    def delete_session(self, session_id: str, if_match: str | None = None) -> Reply:
        """``DELETE /sessions/{id}``; ``if_match``: the request's ``If-Match``, a condition on
        the session's generation (:func:`_if_match_allows`): 412 ``GenerationMismatch`` and
        nothing deleted when it names another. The 204 and the 412 carry the generation."""
        def condition(session: Session) -> None:
            if if_match is not None and not _if_match_allows(if_match, session.generation):
                raise GenerationMismatch(session_id, session.generation, if_match[:64])

        self.expiry.sweep()
        try:
            session = self.registry.remove(session_id, precondition=condition)
        except GenerationMismatch as exc:
            return replace(error_reply(exc), headers=((GENERATION_HEADER, str(exc.generation)),))
        except SessionError as exc:
            return error_reply(exc)
        return Reply(204, b"", content_type="", headers=((GENERATION_HEADER, str(session.generation)),))

    def health(self) -> Reply:
        self.expiry.sweep()
        return json_response(200, {"status": "ok", "session_server_instance_id": self.instance_id,
                                   "sessions": len(self.registry),
                                   "journal_damage": self.registry.store.set_aside})

    def chat(self, session_id: str, body: bytes | memoryview, budget: float | None = None) -> Reply:
        """Run one turn. Blocking; safe to call from many threads/greenlets at once.

        ``budget``: seconds the whole turn may take — its wait for the session's previous turn
        plus the backend call — on top of the core's own timeouts, so a caller with a deadline
        of its own (the router) gets this core's 503 or 502 before it gives up and the turn is
        never committed after its caller was told it failed. None: the core's timeouts only.
        """
        request_timestamp = time.time()
        deadline = None if budget is None else time.monotonic() + budget
        self.expiry.sweep()
        try:
            return self._chat(session_id, body, deadline, request_timestamp)
        except SessionError as exc:
            return error_reply(exc, openai=True)
        except Exception:  # a bug in one turn must not take the worker (and other sessions) down
            log.exception("chat turn on session %s failed", session_id)
            return openai_error_response(500, "internal error in the session core", "server_error", "internal_error")

    def messages(self, session_id: str, body: bytes | memoryview, budget: float | None = None) -> Reply:
        """``POST /sessions/{id}/v1/messages``: one turn asked in Anthropic's Messages API,
        translated (``webapp.anthropic``) and run as :meth:`chat` runs it — the canonical OpenAI
        turn and record —, then answered as Anthropic's message or stream; errors in its shape."""
        try:
            if len(body) > MAX_CHAT_BODY_BYTES:
                raise BodyTooLarge(f"request body over {MAX_CHAT_BODY_BYTES} bytes")
            request = loads_strict(body)
            chat_request = anthropic.chat_request(request)
            session = self.registry.get(session_id)
            anthropic.restore_tool_arguments(chat_request["messages"], anthropic.stored_tool_arguments(
                session.state.messages, session.previous.messages if session.previous else ()))
        except SessionError as exc:
            return anthropic_error_response(exc.status, str(exc))
        reply = self.chat(session_id, json.dumps(chat_request, ensure_ascii=False).encode(), budget)
        if reply.status != 200:
            return replace(json_response(reply.status, anthropic.anthropic_error(reply.status, reply.read())),
                           headers=reply.headers)
        try:
            message = anthropic.message_reply(json.loads(reply.read()), request)
        except SessionError as exc:  # an aborted generation (recorded as the chat route records it)
            return anthropic_error_response(exc.status, str(exc))
        except Exception:  # as in chat: a bug here must not take the worker down
            log.exception("Messages reply of session %s failed", session_id)
            return anthropic_error_response(500, "internal error in the session core")
        if request.get("stream"):
            return Reply(200, list(anthropic.message_events(message)), content_type=SSE_CONTENT_TYPE,
                         headers=reply.headers)
        return replace(json_response(200, message), headers=reply.headers)

    def _chat(self, session_id: str, body: bytes | memoryview, deadline: float | None,
              request_timestamp: float) -> Reply:
        session = self.registry.get(session_id)
        request, url_bytes = _parse_chat_body(body)
        self.limits.check_messages(request.get("messages"))
        # Before the turn lock: the pixel decoding of new images holds up no other turn.
        images = extract_images(request.get("messages"), self.image_limits, session.images, session.image_urls,
                                url_bytes)
        if session.tree is not None:
            return self._tree_chat(session, request, images, deadline, request_timestamp)
        wait = self.turn_wait_timeout
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - time.monotonic()))
        if not session.turn_lock.acquire(timeout=wait):
            raise SessionBusy(f"session {session_id!r}: previous turn still running after {wait:.3g} s")
        try:
            if session.closed:
                raise self.registry.missing(session_id)
            render = self._check_render(session, request)
            plan = plan_turn(session.state, session.previous, images.messages,
                             request.get("tools"), self.tokenizer, self.matcher)
            self.limits.check_prompt(plan.prompt_ids)
            held = self._rows_held(session, plan)
            ids_text = session.journal.prompt_ids_text(plan.prompt_ids)  # the request's and the record's
            engine_request = self.dialect.build_request(request, plan.prompt_ids, images,
                                                        replay_from=held[0] if held else 0, ids_text=ids_text)
            reply = self.backend.send(engine_request.path, engine_request.sent, deadline=deadline)
            turn = self.dialect.parse_reply(reply, engine_request)
            summary, record = self._record(engine_request.recorded, plan, turn, request_timestamp,
                                           tuple(image.sha256 for image, _url in images.images),
                                           replay_prefix=self._replay_prefix(turn, held, plan))
            new_state = commit_turn(plan, turn.assistant_message, turn.output_ids,
                                    self.tokenizer.eos_token_id)
            # A session deleted during the turn: the reply still goes out, nothing is stored.
            # A journal that cannot be written: InsufficientStorage (507), nothing stored.
            generation = session.commit(new_state, plan, summary, record, images.new, images.url_keys, render,
                                        prompt_text=ids_text)
        finally:
            session.turn_lock.release()
        return _with_generation(self._client_reply(turn, request), generation)

    def _tree_chat(self, session: Session, request: dict[str, Any], images: Any, deadline: float | None,
                   request_timestamp: float) -> Reply:
        """A tree session's turn (miles' v2): positioned at the deepest node whose path of
        messages prefixes the request (``SessionTree.find_attach_point``), its prompt the node's
        ids plus the TITO append of the unmatched suffix, committed as a new child of that node.

        No turn lock: as miles' v2, the engine call holds no lock (positioning and commit take
        the state lock briefly), so concurrent generations from one spot both run and become
        siblings; a truncated attach node (409) and a full tree (409) are refused before the
        engine is called."""
        tree = session.tree
        assert tree is not None
        messages = normalize_messages(images.messages)
        render = self._check_render(session, request)  # (reads the journal after a restart: no lock held)
        with session.state_lock:  # a commit adds under it: position on a whole forest
            if session.closed:
                raise self.registry.missing(session.session_id)
            attach = tree.find_attach_point(messages, self.matcher)
            if attach.node is not None and attach.node.truncated:
                raise TruncatedGeneration(
                    f"the request extends node {attach.node.seq}, which ended with finish_reason 'length': "
                    "a truncated generation closes its path for good; branch before the cut instead")
            tree.check_room()
            session.inflight += 1
        try:
            parent = attach.node
            base = parent.state if parent is not None else INITIAL_STATE
            # The stored path's messages stand for the request's that the matcher took as theirs;
            # plan_turn checks the suffix as a line's turn (roles, not ending with an assistant).
            plan = plan_turn(base, None, [*base.messages, *messages[attach.matched:]],
                             request.get("tools"), self.tokenizer)
            self.limits.check_prompt(plan.prompt_ids)
            held = self._rows_held_on(parent.turn if parent is not None else None, plan)
            ids_text = session.journal.prompt_ids_text(plan.prompt_ids)  # the request's and the record's
            engine_request = self.dialect.build_request(request, plan.prompt_ids, images,
                                                        replay_from=held[0] if held else 0, ids_text=ids_text)
            reply = self.backend.send(engine_request.path, engine_request.sent, deadline=deadline)
            turn = self.dialect.parse_reply(reply, engine_request)
            summary, record = self._record(engine_request.recorded, plan, turn, request_timestamp,
                                           tuple(image.sha256 for image, _url in images.images), tree=True,
                                           replay_prefix=self._replay_prefix(turn, held, plan))
            new_state = commit_turn(plan, turn.assistant_message, turn.output_ids, self.tokenizer.eos_token_id)
            response_id = turn.completion.get("id")
            generation = session.commit_node(parent, new_state, plan, summary, record,
                                             response_id if isinstance(response_id, str) else "", images.new,
                                             images.url_keys, render, prompt_text=ids_text)
        finally:
            with session.state_lock:
                session.inflight -= 1
        return _with_generation(self._client_reply(turn, request), generation)

    def _check_render(self, session: Session, request: dict[str, Any]) -> str:
        """The turn's render pin (its ``chat_template_kwargs`` as canonical JSON; absent, null
        and ``{}`` render alike): ``RenderSettingsChanged`` if the session's first turn pinned
        others. Before the engine call: a refused turn sends and records nothing."""
        render = _render_key(request)
        pinned = session.render_pin
        if pinned is None and session.generation:  # restored: the first record says what it sent
            pinned = session.render_pin = _first_render(session)
        if pinned is not None and pinned != render:
            raise RenderSettingsChanged(json.loads(pinned), json.loads(render))
        return render

    def _rows_held(self, session: Session, plan: TurnPlan) -> tuple[int, int] | None:
        """(rows, bytes per row) of the routed experts the session holds for the turn's base
        state, when the dialect can ask for the rest only; None: a full request."""
        records = session.records
        base = (records[-2] if len(records) > 1 else None) if plan.rollback else (records[-1] if records else None)
        return self._rows_held_on(base, plan)

    def _rows_held_on(self, base: TurnRecord | None, plan: TurnPlan) -> tuple[int, int] | None:
        """:meth:`_rows_held` given the record whose state the turn builds on."""
        if not (self.dialect.incremental_replay and self.dialect.replay.routed_experts):
            return None
        rows = len(plan.base.token_ids) - 1
        if base is None or base.record is None or rows <= 0:
            return None
        held = next((f for f in base.record.fields if isinstance(f, Rows) and f.key == "routed_experts"), None)
        if held is None or held.length % rows or not held.length:
            return None  # a first-format record or a payload of another shape: ask for every row
        return rows, held.length // rows

    def _replay_prefix(self, turn: EngineTurn, held: tuple[int, int] | None, plan: TurnPlan) -> dict[str, int]:
        """The record's ``replay_prefix`` after a request that asked only for the rows past
        ``held`` (:meth:`_rows_held`); empty after a full request."""
        return self.dialect.replay_prefix(turn, held, len(plan.prompt_ids)) if held else {}

    @staticmethod
    def _record(payload: bytes, plan: TurnPlan, turn: EngineTurn, request_timestamp: float,
                images: tuple[str, ...] = (), tree: bool = False,
                replay_prefix: dict[str, int] | None = None) -> tuple[TurnRecord, RecordParts]:
        """The record's summary and its parts (the reply is not copied). ``tree``: a tree
        node's, miles' v2 ``SessionRecord`` (no ``rollback``: a tree never rolls back);
        ``replay_prefix``: see :class:`webapp.records.RecordParts`."""
        timestamp = time.time()
        fields: dict[str, Any] = {"timestamp": timestamp, "request_timestamp": request_timestamp, "method": "POST",
                                  "path": CHAT_PATH, "status_code": 200}
        if not tree:
            fields["rollback"] = plan.rollback
        head = json.dumps(fields, separators=(",", ":"))
        parts = RecordParts(head[:-1].encode() + b',"request":', payload, turn.record_response, turn.replay_spans,
                            replay_prefix or {})
        summary = TurnRecord(prompt_len=len(plan.prompt_ids), output_ids=tuple(turn.output_ids),
                             logprobs=tuple(turn.logprobs), finish_reason=turn.finish_reason, meta=turn.meta,
                             timestamp=timestamp, request_timestamp=request_timestamp,
                             replay=tuple(dict.fromkeys(k for k, _s, _e in turn.replay_spans)), images=images)
        return summary, parts

    def _client_reply(self, turn: EngineTurn, request: dict[str, Any]) -> Reply:
        completion = turn.completion
        wants_logprobs = bool(request.get("logprobs"))
        for choice in completion.get("choices") or ():
            if not wants_logprobs:
                choice["logprobs"] = None  # forced on for the records, not asked for by the client
            elif choice.get("logprobs") is None:
                choice["logprobs"] = _openai_logprobs(self.tokenizer, turn)
        if request.get("stream"):
            options = request.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return Reply(200, _sse_chunks(completion, include_usage), content_type=SSE_CONTENT_TYPE)
        return json_response(200, completion)

    def restore_shard(self, shard: int, shards: int, pause: Callable[[], object] = lambda: None) -> int:
        """Load the sessions of ``shard`` of ``shards`` from the journals, and the shard's
        tombstones (``webapp.tombstones``); how many sessions."""
        started = time.monotonic()
        store = self.registry.store
        try:
            self.registry.tombstones = Tombstones.open(
                store.data_dir, shard, shards, self.tombstone_ttl, self.max_tombstones,
                owns=lambda session_id: shard_for(session_id, shards) == shard, fsync=store.fsync)
        except (OSError, WebappError) as exc:  # breadcrumbs: never in the way of the sessions
            log.warning("tombstones of shard %d/%d kept in memory only: %s", shard, shards, exc)
        loaded = self.registry.restore(lambda session_id: shard_for(session_id, shards) == shard, pause)
        log.info("restored %d sessions of shard %d/%d from %s in %.2f s", loaded, shard, shards,
                 self.registry.store.dir, time.monotonic() - started)
        return loaded

    def close(self) -> None:
        self.backend.close()
        self.registry.store.close()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)


def _with_generation(reply: Reply, generation: int) -> Reply:
    """A turn's reply with the generation its commit made (none: deleted during the turn)."""
    return replace(reply, headers=(*reply.headers, (GENERATION_HEADER, str(generation)))) if generation else reply


def _render_key(request: Mapping[str, Any]) -> str:
    kwargs = request.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise InvalidField("chat_template_kwargs", "expected an object")
    return json.dumps(kwargs, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _first_render(session: Session) -> str | None:
    """The render pin of a restored session: its first committed turn's ``chat_template_kwargs``
    as its record's request holds them (every dialect records the client's). None if unreadable
    (logged): the session is then pinned by its next turn."""
    with session.state_lock:
        if session.tree is not None and len(session.tree):
            first = session.tree.nodes[0]
            turn, ids = first.turn, first.state.token_ids
        elif session.records:
            turn, ids = session.records[0], session.state.token_ids
        else:
            return None
    try:
        assert turn.record is not None, "a committed record is in the journal"
        request = json.loads(read_pieces(turn.record.pieces(IdsText(ids).prefix)))["request"]
        return _render_key(request)
    except Exception:
        log.exception("the first record of session %s does not say its chat_template_kwargs", session.session_id)
        return None


def _if_match_allows(value: str, generation: int) -> bool:
    """``If-Match`` (RFC 9110 13.1.1) against a session's generation: ``*`` (any session), or a
    list of entity tags one of which is the generation (``"3"``; a bare ``3`` too). A weak tag
    (``W/"3"``) never matches: If-Match compares strongly."""
    for tag in value.split(","):
        tag = tag.strip()
        if tag == "*":
            return True
        if tag.startswith('"') and tag.endswith('"') and len(tag) >= 2:
            tag = tag[1:-1]
        if tag == str(generation):
            return True
    return False


def _session_images(session: Session) -> list[StoredImage]:
    with session.state_lock:
        return list(session.images.values())


def _metadata_json(metadata: dict[str, Any], ids_text: bytes) -> bytes:
    """``json.dumps(metadata)``, compact, with ``accumulated_token_ids`` spliced in as
    ``ids_text`` (their JSON text between the brackets: the records GET's own, cached per
    state): a long session's one big list is not encoded a second time on its first GET."""
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    side = before
    for key, value in metadata.items():
        if key == "accumulated_token_ids":
            side = after
        else:
            side[key] = value
    head = json.dumps(before, separators=(",", ":")).encode()[:-1]  # '{' and the keys before
    tail = json.dumps(after, separators=(",", ":")).encode()[1:]  # the keys after and '}'
    return b"".join((head, b"," if before else b"", b'"accumulated_token_ids":[', ids_text, b"]",
                     b"," if after else b"", tail))


def _images_json(session: Session) -> list[bytes]:
    """``,"images":{sha256: {mime_type, width, height, data}}`` of the session's committed images."""
    images = _session_images(session)
    out = [b',"images":{']
    for i, image in enumerate(images):
        meta = json.dumps({"mime_type": image.mime_type, "width": image.width, "height": image.height},
                          separators=(",", ":"))
        out += ((b"," if i else b"") + f'"{image.sha256}":'.encode() + meta[:-1].encode() + b',"data":"',
                base64.b64encode(image.data), b'"}')
    out.append(b"}")
    return out


def _parse_samples_body(body: bytes) -> tuple[int | None, dict[str, Any] | None]:
    """``{"max_seq_len": int | null, "metadata": object | null}`` (an empty body is ``{}``) ->
    (max_seq_len, the agent's metadata). miles reads ``metadata`` on v2 (tree) sessions only
    (``server.py``); a linear session checks it and leaves it unused, as miles' v1 ignores it."""
    params = loads_strict(body) if body.strip() else {}
    if not isinstance(params, dict):
        raise InvalidJSON("invalid JSON body: expected an object")
    value = params.get("max_seq_len")
    if value is not None and (type(value) is not int or value < 1):
        raise InvalidField("max_seq_len", "expected a positive integer or null")
    agent = params.get("metadata")
    if agent is not None and not isinstance(agent, dict):
        raise InvalidField("metadata", "expected an object or null")
    return value, agent


def _auto_kind(url: str) -> str:
    """``auto`` without the launcher: what the engine says, else sglang (the core must build while
    the engine is down; the turns then answer 502 until it is up)."""
    try:
        found = identify_engine(url).kind
    except (EngineCheckFailed, requests.RequestException) as exc:
        log.warning("backend kind auto: %s; speaking sglang", exc)
        return "sglang"
    if found is None:
        log.warning("backend kind auto: %s is neither SGLang nor vLLM; speaking sglang", url)
    log.info("backend kind auto: %s speaks %s", url, found or "sglang")
    return found or "sglang"


def build_session_core(config: CoreConfig, shard: int | None = 0, shards: int = 1) -> SessionCore:
    """The one builder every adapter uses, so single- and multi-process modes cannot drift.

    Loads the sessions of ``shard`` of ``shards`` from the data directory's journals first
    (all of them for the single-process app), so a restarted worker serves what it served;
    ``shard=None``: not now, the caller calls :meth:`SessionCore.restore_shard` itself."""
    tokenizer = load_tokenizer(config.tokenizer)
    registry = SessionRegistry(JournalStore(config.data_dir or default_data_dir(), fsync=config.fsync,
                                            max_session_bytes=config.max_session_bytes,
                                            max_data_bytes=config.max_data_bytes))
    replay = ReplayRequest(routed_experts=config.routing_replay_layers > 0, indexer_topk=bool(config.indexer_replay))
    kind = config.backend_kind
    if kind == "auto":  # the launcher resolves it once (and fails clearly); this is an app built without it
        kind = _auto_kind(config.backend_url)
    backend = BackendClient(config.backend_url, connect_timeout=config.connect_timeout,
                            read_timeout=config.read_timeout, pool_maxsize=config.pool_maxsize,
                            name=f"{kind} engine")
    core = SessionCore(tokenizer, backend, registry=registry, turn_wait_timeout=config.turn_wait(),
                       dialect=dialect_for(kind, replay, tool_call_parser=config.tool_call_parser),
                       routing_replay_layers=int(config.routing_replay_layers),
                       indexer_replay=bool(config.indexer_replay),
                       limits=RequestLimits(config.max_message_bytes, config.max_prompt_tokens),
                       max_sessions=config.max_sessions, session_idle_ttl=config.session_idle_ttl,
                       image_limits=ImageLimits(config.max_image_bytes, config.max_images),
                       session_mode=config.session_mode,
                       matcher=resolve_matcher(config.session_message_matcher),
                       sample_hooks=SampleHooks.resolve(config.session_sample_picker_path,
                                                        config.session_sample_postprocessor_path),
                       tombstone_ttl=config.tombstone_ttl, max_tombstones=config.max_tombstones)
    if shard is not None:
        core.restore_shard(shard, shards)
    return core
