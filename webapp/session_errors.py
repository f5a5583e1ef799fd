"""Errors of the session core, each carrying the HTTP status an adapter answers with.

Every adapter (the Flask app, the data-plane worker) gets a caught ``SessionError`` as a
``core.Reply`` built by ``core.error_reply``, so single- and multi-process modes answer alike:
``{"error": "<text>"}`` on the session-management routes (miles' shape), and OpenAI's
``{"error": {"message", "type", "code"}}`` on the OpenAI routes (``/sessions/{id}/v1/...``),
where ``code`` is :attr:`SessionError.code` (the class name in snake case, so a client can
branch on it) and ``type`` is :attr:`SessionError.openai_type`. ``UpstreamStatus`` is the one
exception whose body is passed through verbatim. Texts a miles client could match on are
worded as miles words them (``session not found: session_id=...``, ``invalid JSON body: ...``).

Exception tree (a branch of :class:`webapp.errors.WebappError`)::

    SessionError                      status 500 unless a subclass says otherwise
    ├── BadRequest                    400  the client broke the rules; nothing is stored
    │   ├── InvalidJSON               400  body is not UTF-8 JSON (or not an object)
    │   ├── InvalidField              400  a field is missing or has the wrong type/value
    │   │   ├── UnknownField          400  a top-level field the server neither forwards nor uses
    │   │   └── UnmappableField       400  a Messages API field or block with no chat-turn equivalent
    │   ├── BodyTooLarge              413  request body over the named limit, refused unread
    │   │   └── LimitExceeded         413  the request would make the core do more work than a limit allows (webapp.limits)
    │   ├── ImageRefused              400  an image part the server does not take (webapp.images)
    │   │   ├── RemoteImageURL        400  not a data:image/jpeg|png;base64 URL (nothing is fetched)
    │   │   ├── ImageNotBase64        400  the data URL's payload is not base64
    │   │   ├── ImageUndecodable      400  not a decodable JPEG/PNG, or a shape the vision rule refuses
    │   │   ├── ImageTooLarge         400  over max_image_bytes or the pixel cap
    │   │   └── TooManyImages         400  over max_images in one request
    │   ├── AppendOnlyViolation       400  messages do not extend the stored ones
    │   │   └── RollbackTooDeep       400  rolls back more than one assistant step
    │   └── RenderSettingsChanged     400  a turn's chat_template_kwargs differ from the session's first turn's
    ├── SessionNotFound               404  a session id this server never had (or whose tombstone is gone)
    ├── SessionGone                   410  a deleted or expired session, while its tombstone lasts (webapp.tombstones)
    ├── GenerationMismatch            412  DELETE's If-Match names another generation; nothing deleted
    ├── SessionExists                 409  create_session with an id already in use
    ├── TruncatedGeneration           409  a tree session's request extends a length-truncated generation
    ├── TreeFull                      409  a tree session holds its maximum of nodes (webapp.tree)
    ├── SessionBusy                   503  waited too long for the session's previous turn
    ├── TooManySessions               429  the open-session cap is reached (webapp.limits)
    ├── InsufficientStorage           507  the journal could not be written; nothing stored
    │   └── StorageBudget             507  over max_session_bytes or max_data_bytes (``limit``)
    ├── JournalDamaged                500  the journal changed under the server; not served
    ├── TokenPrefixMismatch           500  the template re-renders stored turns differently
    ├── MessageMatcherFailed          500  the configured message matcher raised or returned a non-bool (webapp.matchers)
    ├── GenerationAborted             529  the engine aborted the generation (Messages route); retry
    ├── SampleAssemblyError           422  the records cannot be assembled into a training sample
    │   └── SampleHookFailed          422  a tree session's picker or post-processor raised or broke its contract
    ├── BackendError                  502  the backend failed us
    │   ├── BackendUnreachable        502  connect/transport error
    │   │   └── BackendTimeout        502  connect or read timeout
    │   └── BackendMalformed          502  reply is not the backend contract
    │       └── MalformedReplyField   502  one named reply field is missing or wrong (``field``)
    └── UpstreamStatus                the backend's own non-200 status, passed through unrecorded

``tests/test_error_trees.py`` checks this drawing against the classes.
"""

from __future__ import annotations

import re

from webapp.errors import WebappError

__all__ = [
    "GONE_REASONS",
    "AppendOnlyViolation",
    "BackendError",
    "BackendMalformed",
    "BackendTimeout",
    "BackendUnreachable",
    "BadRequest",
    "BodyTooLarge",
    "GenerationAborted",
    "GenerationMismatch",
    "ImageNotBase64",
    "ImageRefused",
    "ImageTooLarge",
    "ImageUndecodable",
    "InsufficientStorage",
    "InvalidField",
    "InvalidJSON",
    "JournalDamaged",
    "MalformedReplyField",
    "RemoteImageURL",
    "RenderSettingsChanged",
    "RollbackTooDeep",
    "SampleAssemblyError",
    "SampleHookFailed",
    "SessionBusy",
    "SessionError",
    "SessionExists",
    "SessionGone",
    "SessionNotFound",
    "StorageBudget",
    "TokenPrefixMismatch",
    "TooManyImages",
    "TreeFull",
    "TruncatedGeneration",
    "UnknownField",
    "UnmappableField",
    "UpstreamStatus",
]


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


class SessionError(WebappError):
    """Base of every error the session core raises on purpose."""

    status: int = 500
    openai_type: str = "server_error"  # OpenAI's error ``type`` on the OpenAI routes

    @property
    def code(self) -> str:
        """The stable machine-readable name of this error: ``SessionNotFound`` -> ``session_not_found``."""
        return _snake(type(self).__name__)


class BadRequest(SessionError):
    status = 400
    openai_type = "invalid_request_error"


class InvalidJSON(BadRequest):
    pass


class InvalidField(BadRequest):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.field = field
        self.problem = problem

    def __str__(self) -> str:
        return f"invalid field {self.field!r}: {self.problem}"


class UnknownField(InvalidField):
    """A top-level request field the server neither forwards to the engine nor uses itself
    (``webapp.request_fields``): refused by name rather than stored every turn."""


class UnmappableField(InvalidField):
    """``POST /sessions/{id}/v1/messages``: a field or content block of Anthropic's Messages API
    that cannot be mapped onto an OpenAI chat turn (``webapp.anthropic``): refused by name."""


class BodyTooLarge(BadRequest):
    status = 413


class ImageRefused(BadRequest):
    """An image part refused; ``where`` is its place (``messages[i].content[j]``), the class
    the reason (its ``code``: ``remote_image_url``, ``image_not_base64`` ...)."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(where, problem)
        self.where = where
        self.problem = problem

    def __str__(self) -> str:
        return f"image refused at {self.where} ({self.code}): {self.problem}"


class RemoteImageURL(ImageRefused):
    pass


class ImageNotBase64(ImageRefused):
    pass


class ImageUndecodable(ImageRefused):
    pass


class ImageTooLarge(ImageRefused):
    pass


class TooManyImages(ImageRefused):
    pass


class AppendOnlyViolation(BadRequest):
    pass


class RollbackTooDeep(AppendOnlyViolation):
    pass


class RenderSettingsChanged(BadRequest):
    """400: the turn's ``chat_template_kwargs`` differ from those of the session's first
    committed turn. A session's tokens are one rendering: a template setting that changes
    mid-session (a thinking mode, say) would render the history differently from the tokens
    already stored. Nothing is sent to the engine or recorded."""

    def __init__(self, pinned: object, sent: object) -> None:
        super().__init__(f"chat_template_kwargs are fixed per session: its first turn rendered with {pinned!r}, "
                         f"this turn sent {sent!r}; start a new session to render with other settings")
        self.pinned = pinned
        self.sent = sent


class SessionNotFound(SessionError):
    status = 404
    openai_type = "not_found_error"

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.session_id = session_id

    def __str__(self) -> str:
        return f"session not found: session_id={self.session_id}"  # miles' wording


# Why a session is gone, SessionGone's parenthesis for each: the tombstones' reasons (webapp.tombstones).
GONE_REASONS = {
    "deleted": "the trainer released this session and is no longer waiting for the agent",
    "expired": "it expired: unused for longer than the server's session_idle_ttl",
    "damaged": "its journal was found damaged when the server started and was set aside, see the server's log",
}


class SessionGone(SessionError):
    """410 (miles' ``SessionReclaimedError``): the session existed here and was deleted, or
    expired unused, or a restart found its journal damaged past serving (``reason``: ``deleted``,
    ``expired`` or ``damaged``), so a client still at work learns it was let go instead of
    getting the 404 of a mistyped id. A sibling of
    :class:`SessionNotFound`, not a kind of it: catching one never swallows the other. Lasts as
    long as the id's tombstone (``tombstone_ttl``, ``max_tombstones``: :mod:`webapp.tombstones`)."""

    status = 410
    openai_type = "not_found_error"

    def __init__(self, session_id: str, reason: str = "deleted") -> None:
        super().__init__(session_id, reason)
        self.session_id = session_id
        self.reason = reason

    def __str__(self) -> str:
        # miles' wording, which a client may match on; an expiry says so instead
        return f"session reclaimed: session_id={self.session_id} ({GONE_REASONS[self.reason]})"


class GenerationMismatch(SessionError):
    """412: a conditional ``DELETE /sessions/{id}`` whose ``If-Match`` names none of the
    session's current generation (``generation``: the number of turns committed to it); the
    session is left as it is."""

    status = 412
    openai_type = "invalid_request_error"

    def __init__(self, session_id: str, generation: int, wanted: str) -> None:
        super().__init__(session_id, generation, wanted)
        self.session_id = session_id
        self.generation = generation
        self.wanted = wanted

    def __str__(self) -> str:
        return (f"session {self.session_id} is at generation {self.generation}, If-Match asked for {self.wanted!r}: "
                "nothing was deleted")


class SessionExists(SessionError):
    status = 409
    openai_type = "invalid_request_error"

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.session_id = session_id

    def __str__(self) -> str:
        return f"session {self.session_id!r} already exists"


class TruncatedGeneration(SessionError):
    """409 (miles' ``TruncatedGenerationError``): the request attaches under a generation that
    ended at the length cap, which closes its path for good; branch before the cut instead.
    Nothing is sent to the engine or stored."""

    status = 409
    openai_type = "invalid_request_error"


class TreeFull(SessionError):
    """409: the tree session holds ``limit`` nodes and cannot branch or extend further (far past
    any real retry pattern: the harness is most likely not replaying its history verbatim).
    Checked before the engine is called; nothing is stored."""

    status = 409
    openai_type = "invalid_request_error"

    def __init__(self, limit: int) -> None:
        super().__init__(f"the session's tree holds its maximum of {limit} nodes: it cannot branch or extend "
                         "further (is the client replaying its history verbatim?)")
        self.limit = limit


class SessionBusy(SessionError):
    status = 503


class InsufficientStorage(SessionError):
    """The session journal could not be written (a full disk, a file-size limit, an I/O error):
    the turn or session was not stored, in the file or in memory; retry when there is room."""

    status = 507


class StorageBudget(InsufficientStorage):
    """507: storing this would take the session's journal past ``max_session_bytes`` or the
    server's journals past ``max_data_bytes`` (``limit`` names which); nothing was stored."""

    def __init__(self, limit: str, allowed: int, needed: int, what: str) -> None:
        super().__init__(f"{what} was not stored: it needs {needed} bytes, over the limit {limit}={allowed}")
        self.limit = limit
        self.allowed = allowed
        self.needed = needed


class JournalDamaged(SessionError):
    """The session's journal no longer holds what the server wrote (changed or damaged on disk
    while it runs): its records are not served; a restart keeps what verifies and sets the rest
    aside (docs/session-server-ops.md)."""

    status = 500


class TokenPrefixMismatch(SessionError):
    status = 500


class GenerationAborted(SessionError):
    """The Messages route's answer to a turn whose generation the engine aborted (finish reason
    ``abort``): Anthropic's retryable 529 ``overloaded_error``, as miles answers it. The turn is
    recorded as the chat route records it; the retry rolls it back (the same messages again)."""

    status = 529


class SampleAssemblyError(SessionError):
    """``POST /sessions/{id}/samples``: the records break an assembly rule (miles answers 422
    with its assertion text); nothing about the session changes."""

    status = 422
    openai_type = "invalid_request_error"


class SampleHookFailed(SampleAssemblyError):
    """A tree session's samples picker or post-processor (``webapp.tree_samples``) raised or
    broke its contract: miles' 422 naming both hooks as configured (``picker``,
    ``postprocessor``)."""

    def __init__(self, message: str, *, picker: str, postprocessor: str) -> None:
        super().__init__(message)
        self.picker = picker
        self.postprocessor = postprocessor


class BackendError(SessionError):
    status = 502
    openai_type = "upstream_error"


class BackendUnreachable(BackendError):
    pass


class BackendTimeout(BackendUnreachable):
    pass


class BackendMalformed(BackendError):
    pass


class MalformedReplyField(BackendMalformed):
    """A reply field breaks the engine dialect's contract: ``field`` names it (e.g.
    ``choices[0].token_ids``), the message says what is wrong. Its OpenAI ``code`` stays
    ``backend_malformed`` (one code for a client to branch on; Python callers have ``field``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    @property
    def code(self) -> str:
        return "backend_malformed"


class UpstreamStatus(SessionError):
    """The backend answered non-200: the adapter relays its status and body untouched."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.content_type = content_type

    def __str__(self) -> str:
        return f"backend answered HTTP {self.status}"
