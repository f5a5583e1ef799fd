"""The session core: sessions, TITO turns and records, answered as transport-independent ``Reply``.

Every adapter (the single-process Flask app, the data-plane worker) builds the core with
``build_session_core`` and turns each ``Reply`` into its own transport, so the modes cannot
drift. Concurrency: ``chat`` runs in many greenlets or threads at once. Each session has a
*turn lock* (serializes its turns, held across the backend call, never shared between
sessions) and a *state lock* (held only to swap the committed state or snapshot it), so a
records GET never waits for a turn in flight and no lock serializes two sessions.

Each committed record is kept pre-serialized as a few byte chunks — a small JSON head, the
client's request body and the backend's reply body exactly as received (R3 included) — so a
records GET is a list of existing chunks, never re-encoded or joined.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from webapp.backend import BackendClient, BackendReply
from webapp.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_IDLE_TTL,
    RequestLimits,
    SessionExpiry,
    loads_strict,
)
from webapp.session_errors import (
    BackendMalformed,
    BodyTooLarge,
    InvalidField,
    InvalidJSON,
    SessionBusy,
    SessionError,
    SessionExists,
    SessionNotFound,
    UpstreamStatus,
)
from webapp.tito import INITIAL_STATE, TitoState, TurnPlan, commit_turn, normalize_message, plan_turn
from webapp.tokenizers import ChatTokenizer, load_tokenizer

__all__ = [
    "MAX_CHAT_BODY_BYTES",
    "SESSION_ID_PATTERN",
    "CoreConfig",
    "Reply",
    "Session",
    "SessionCore",
    "SessionRegistry",
    "build_session_core",
    "error_response",
    "json_response",
]

log = logging.getLogger(__name__)

# Computer-use turns carry base64 screenshots; a few dozen 1080p PNGs fit well within this.
MAX_CHAT_BODY_BYTES = 256 << 20
SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")
# Fields the core sets on every backend request, whatever the client sent.
FORCED_BACKEND_FIELDS: dict[str, Any] = {"stream": False, "logprobs": True, "return_meta_info": True}
# Client fields that only concern the client-facing transport.
CLIENT_ONLY_FIELDS = ("stream", "stream_options")
SSE_CONTENT_TYPE = "text/event-stream"


@dataclass
class Reply:
    """One HTTP answer. A list body is the chunks of one body, to be sent without joining."""

    status: int
    body: bytes | list[bytes]
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def chunks(self) -> list[bytes]:
        return self.body if isinstance(self.body, list) else [self.body]

    @property
    def content_length(self) -> int:
        return sum(len(c) for c in self.chunks)


def json_response(status: int, obj: Any) -> Reply:
    return Reply(status, json.dumps(obj, separators=(",", ":")).encode())


def error_response(status: int, message: str) -> Reply:
    """The error shape of every adapter: ``{"error": "<message>"}``."""
    return json_response(status, {"error": message})


def _reply_for(exc: SessionError) -> Reply:
    if isinstance(exc, UpstreamStatus):
        return Reply(exc.status, exc.body, exc.content_type)
    return error_response(exc.status, str(exc))


@dataclass
class CoreConfig:
    backend_url: str
    tokenizer: str | None = None  # None: the byte tokenizer; else a dir with tokenizer.json + template
    connect_timeout: float = 5.0
    read_timeout: float = 600.0
    pool_maxsize: int = 64  # pooled backend connections per core (one per concurrent turn)
    turn_wait_timeout: float | None = None  # wait for a session's previous turn; None: connect+read+30
    request_routed_experts: bool = True  # ask the backend for R3 (``return_routed_experts``)
    # Work and session bounds; see webapp.limits.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    max_sessions: int = DEFAULT_MAX_SESSIONS
    session_idle_ttl: float = DEFAULT_SESSION_IDLE_TTL


@dataclass(eq=False)
class Session:
    session_id: str
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)  # for the idle expiry
    turn_lock: threading.Lock = field(default_factory=threading.Lock)
    state_lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    state: TitoState = INITIAL_STATE
    previous: TitoState | None = None
    records: list[tuple[bytes, ...]] = field(default_factory=list)
    metadata: bytes = b""

    def __post_init__(self) -> None:
        self.metadata = self._metadata_bytes()

    def _metadata_bytes(self) -> bytes:
        return json.dumps({
            "accumulated_token_ids": self.state.token_ids,
            "num_records": len(self.records),
            "num_messages": len(self.state.messages),
            "created_at": self.created_at,
        }, separators=(",", ":")).encode()

    def commit(self, new_state: TitoState, base: TitoState, record: tuple[bytes, ...]) -> bool:
        """Store a finished turn; False (nothing stored) if the session was closed meanwhile."""
        with self.state_lock:
            if self.closed:
                return False
            self.previous, self.state = base, new_state
            self.records.append(record)
            self.metadata = self._metadata_bytes()
            return True

    def snapshot(self) -> tuple[list[tuple[bytes, ...]], bytes]:
        with self.state_lock:
            return list(self.records), self.metadata


class SessionRegistry:
    """Live sessions by id. A deleted session leaves at once, so it 404s while a turn finishes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def create_session(self, session_id: str | None = None, admit: Any = None) -> Session:
        """``admit(live_count)`` may refuse (raise) before a session is added."""
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif not isinstance(session_id, str) or not SESSION_ID_PATTERN.fullmatch(session_id):
            raise InvalidField("session_id", f"must match {SESSION_ID_PATTERN.pattern}")
        with self._lock:
            if session_id in self._sessions:
                raise SessionExists(session_id)
            if admit is not None:
                admit(len(self._sessions))
            session = self._sessions[session_id] = Session(session_id)
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(session_id)
        session.last_used = time.monotonic()
        return session

    def idle_since(self) -> list[tuple[str, float]]:
        """``(session_id, last_used)`` of every session without a turn in flight."""
        return [(sid, s.last_used) for sid, s in list(self._sessions.items()) if not s.turn_lock.locked()]

    def remove(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise SessionNotFound(session_id)
        with session.state_lock:
            session.closed = True
        return session

    def __len__(self) -> int:
        return len(self._sessions)


def _parse_chat_body(body: bytes) -> dict[str, Any]:
    if len(body) > MAX_CHAT_BODY_BYTES:
        raise BodyTooLarge(f"request body over {MAX_CHAT_BODY_BYTES} bytes")
    request = loads_strict(body)
    if not isinstance(request, dict):
        raise InvalidJSON("request body must be a JSON object")
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
    return request


@dataclass
class _Turn:
    """What a backend reply yields for the record and the session state."""

    assistant_message: dict[str, Any]
    output_ids: list[int]
    logprobs: list[Any]
    finish_reason: Any


def _parse_turn(parsed: dict[str, Any]) -> _Turn:
    choices = parsed.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise BackendMalformed("backend reply must have exactly one choice")
    choice = choices[0]
    meta = choice.get("meta_info")
    if not isinstance(meta, dict):
        raise BackendMalformed("backend choice has no meta_info object")
    pairs = meta.get("output_token_logprobs")
    if not isinstance(pairs, list):
        raise BackendMalformed("meta_info.output_token_logprobs must be a list")
    try:
        output_ids = [p[1] for p in pairs]
        logprobs = [p[0] for p in pairs]
    except (TypeError, IndexError, KeyError) as exc:
        raise BackendMalformed("output_token_logprobs entries must be [logprob, token_id]") from exc
    if not all(type(t) is int for t in output_ids):
        raise BackendMalformed("output token ids must be integers")
    if not all(lp is None or type(lp) in (int, float) for lp in logprobs):
        raise BackendMalformed("output logprobs must be numbers")
    completion_tokens = meta.get("completion_tokens")
    if completion_tokens is not None and completion_tokens != len(output_ids):
        raise BackendMalformed(
            f"completion_tokens={completion_tokens!r} but {len(output_ids)} output_token_logprobs")
    try:
        message = normalize_message(choice.get("message"), "choices[0].message")
    except InvalidField as exc:
        raise BackendMalformed(f"backend reply: {exc}") from exc
    if message["role"] != "assistant":
        raise BackendMalformed("backend reply message role is not 'assistant'")
    return _Turn(message, output_ids, logprobs, choice.get("finish_reason"))


def _strip_routed_experts(parsed: dict[str, Any]) -> None:
    for choice in parsed.get("choices") or ():
        meta = choice.get("meta_info")
        if isinstance(meta, dict):
            meta.pop("routed_experts", None)
    if isinstance(parsed.get("meta_info"), dict):
        parsed["meta_info"].pop("routed_experts", None)


def _sse_chunks(completion: dict[str, Any], include_usage: bool) -> list[bytes]:
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
        events.append({**base, "choices": [{"index": index, "delta": delta, "finish_reason": None}]})
        events.append({**base, "choices": [{"index": index, "delta": {},
                                            "finish_reason": choice.get("finish_reason")}]})
    if include_usage:
        events.append({**base, "choices": [], "usage": completion.get("usage")})
    out = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events]
    out.append(b"data: [DONE]\n\n")
    return out


class SessionCore:
    """The five operations of the session server; each returns a ``Reply`` and never raises
    for a client, backend or session error (those become error replies)."""

    def __init__(self, tokenizer: ChatTokenizer, backend: BackendClient, *,
                 registry: SessionRegistry | None = None, turn_wait_timeout: float = 630.0,
                 request_routed_experts: bool = True, limits: RequestLimits | None = None,
                 max_sessions: int = DEFAULT_MAX_SESSIONS,
                 session_idle_ttl: float = DEFAULT_SESSION_IDLE_TTL) -> None:
        self.tokenizer = tokenizer
        self.backend = backend
        self.registry = registry if registry is not None else SessionRegistry()
        self.limits = limits if limits is not None else RequestLimits()
        self.expiry = SessionExpiry(max_sessions, session_idle_ttl, self.registry.idle_since,
                                    self.registry.remove)
        self.turn_wait_timeout = turn_wait_timeout
        self.forced_fields = dict(FORCED_BACKEND_FIELDS)
        if request_routed_experts:
            self.forced_fields["return_routed_experts"] = True

    def create_session(self, session_id: str | None = None) -> Reply:
        self.expiry.sweep()
        try:
            session = self.registry.create_session(session_id, admit=self.expiry.admit)
        except SessionError as exc:
            return _reply_for(exc)
        return json_response(200, {"session_id": session.session_id})

    def get_session(self, session_id: str) -> Reply:
        self.expiry.sweep()
        try:
            session = self.registry.get(session_id)
        except SessionError as exc:
            return _reply_for(exc)
        records, metadata = session.snapshot()
        body = [json.dumps({"session_id": session_id}, separators=(",", ":"))[:-1].encode()
                + b',"records":[']
        sep = b""
        for head, request, mid, response in records:
            body += (sep + head, request, mid, response)
            sep = b"},"
        body.append((b"}" if records else b"") + b'],"metadata":')
        body += (metadata, b"}")
        return Reply(200, body)

    def delete_session(self, session_id: str) -> Reply:
        try:
            self.registry.remove(session_id)
        except SessionError as exc:
            return _reply_for(exc)
        return Reply(204, b"", content_type="")

    def health(self) -> Reply:
        self.expiry.sweep()
        return json_response(200, {"status": "ok", "sessions": len(self.registry)})

    def chat(self, session_id: str, body: bytes, budget: float | None = None) -> Reply:
        """Run one turn. Blocking; safe to call from many threads/greenlets at once.

        ``budget``: seconds the whole turn may take — its wait for the session's previous turn
        plus the backend call — on top of the core's own timeouts, so a caller with a deadline
        of its own (the router) gets this core's 503 or 502 before it gives up and the turn is
        never committed after its caller was told it failed. None: the core's timeouts only.
        """
        deadline = None if budget is None else time.monotonic() + budget
        self.expiry.sweep()
        try:
            return self._chat(session_id, body, deadline)
        except SessionError as exc:
            return _reply_for(exc)
        except Exception:  # a bug in one turn must not take the worker (and other sessions) down
            log.exception("chat turn on session %s failed", session_id)
            return error_response(500, "internal error in the session core")

    def _chat(self, session_id: str, body: bytes, deadline: float | None) -> Reply:
        session = self.registry.get(session_id)
        request = _parse_chat_body(body)
        self.limits.check_messages(request.get("messages"))
        wait = self.turn_wait_timeout
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - time.monotonic()))
        if not session.turn_lock.acquire(timeout=wait):
            raise SessionBusy(f"session {session_id!r}: previous turn still running after {wait:.3g} s")
        try:
            if session.closed:
                raise SessionNotFound(session_id)
            plan = plan_turn(session.state, session.previous, request.get("messages"),
                             request.get("tools"), self.tokenizer)
            self.limits.check_prompt(plan.prompt_ids)
            payload = self._backend_payload(request, plan)
            reply = self.backend.chat_completions(payload, deadline=deadline)
            turn = _parse_turn(reply.parsed)
            record = self._record(session, request, body, plan, turn, reply)
            new_state = commit_turn(plan, turn.assistant_message, turn.output_ids,
                                    self.tokenizer.eos_token_id)
            # A session deleted during the turn: the reply still goes out, nothing is stored.
            session.commit(new_state, plan.base, record)
        finally:
            session.turn_lock.release()
        return self._client_reply(reply.parsed, request)

    def _backend_payload(self, request: dict[str, Any], plan: TurnPlan) -> bytes:
        payload = {k: v for k, v in request.items() if k not in CLIENT_ONLY_FIELDS}
        payload.update(self.forced_fields)
        payload["input_ids"] = plan.prompt_ids
        return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()

    @staticmethod
    def _record(session: Session, request: dict[str, Any], body: bytes, plan: TurnPlan, turn: _Turn,
                reply: BackendReply) -> tuple[bytes, ...]:
        head = json.dumps({
            "turn": len(session.records),
            "created_at": time.time(),
            "rollback": plan.rollback,
            "prompt_token_ids": plan.prompt_ids,
            "output_token_ids": turn.output_ids,
            "output_token_logprobs": turn.logprobs,
            "finish_reason": turn.finish_reason,
        }, separators=(",", ":"))
        return (b"{" + head[1:-1].encode() + b',"request":', body, b',"response":', reply.raw)

    @staticmethod
    def _client_reply(parsed: dict[str, Any], request: dict[str, Any]) -> Reply:
        _strip_routed_experts(parsed)
        if request.get("stream"):
            options = request.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return Reply(200, _sse_chunks(parsed, include_usage), content_type=SSE_CONTENT_TYPE)
        return json_response(200, parsed)

    def close(self) -> None:
        self.backend.close()


def build_session_core(config: CoreConfig) -> SessionCore:
    """The one builder every adapter uses, so single- and multi-process modes cannot drift."""
    wait = config.turn_wait_timeout
    if wait is None:
        wait = config.connect_timeout + config.read_timeout + 30.0
    backend = BackendClient(config.backend_url, connect_timeout=config.connect_timeout,
                            read_timeout=config.read_timeout, pool_maxsize=config.pool_maxsize)
    return SessionCore(load_tokenizer(config.tokenizer), backend, turn_wait_timeout=wait,
                       request_routed_experts=config.request_routed_experts,
                       limits=RequestLimits(config.max_message_bytes, config.max_prompt_tokens),
                       max_sessions=config.max_sessions, session_idle_ttl=config.session_idle_ttl)
