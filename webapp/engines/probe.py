"""Start-up checks of the engine behind ``--backend-url``: where it is, what it is, whether our
tokenizer is its tokenizer. Each failure is one typed error whose message is one line.

- :func:`check_backend_url`: an ``http``/``https`` URL with a host and a valid port, at once.
- :func:`identify_engine`: asks the engine what it is. SGLang answers ``GET /get_model_info``
  with ``model_path`` (its native API; the reference backend answers it too); vLLM answers
  ``GET /v1/models`` with ``owned_by: "vllm"`` and ``GET /version``. A refused connection is
  :class:`EngineUnreachable` at once; an engine that accepts connections but does not answer
  yet (vLLM opens its port before it loads the model) is waited for by :func:`wait_for_engine`.
- :func:`resolve_kind`: the configured kind against what was found (``auto`` takes it, and
  speaks sglang to an engine it cannot identify).
- :func:`check_vocabulary`: vLLM's ``POST /tokenize`` of a probe text must give our
  tokenizer's ids, and ``POST /detokenize`` must know our largest id. (SGLang: not checked.)
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests

from webapp.errors import WebappError
from webapp.tokenizers import ChatTokenizer

__all__ = ["PROBE_TEXT", "BackendURLError", "EngineCheckFailed", "EngineIdentity", "EngineKindMismatch",
           "EngineNotAnswering", "EngineUnreachable", "VocabularyMismatch", "check_backend_url",
           "check_vocabulary", "identify_engine", "resolve_kind", "wait_for_engine"]

PROBE_TIMEOUT = 3.0
# Plain text the tokenizers must split alike: ASCII words, digits, punctuation, accents, CJK, an emoji.
PROBE_TEXT = "Hello, world! The session server checks 12345 tokens: déjà vu, 日本語, 🙂."


class EngineCheckFailed(WebappError):
    """The engine behind ``--backend-url`` cannot be used as configured (the message says why)."""


class BackendURLError(EngineCheckFailed):
    """``--backend-url`` is not an http(s) URL with a host and a valid port."""


class EngineUnreachable(EngineCheckFailed):
    """Nothing answers at the backend URL (refused, unresolvable, reset)."""


class EngineNotAnswering(EngineCheckFailed):
    """The engine accepts connections but answered nothing within the wait."""


class EngineKindMismatch(EngineCheckFailed):
    """The engine is of another kind than ``--backend-kind``, or ``auto`` could not tell."""


class VocabularyMismatch(EngineCheckFailed):
    """Our tokenizer is not the engine's: token ids would mean other text."""


@dataclass(frozen=True)
class EngineIdentity:
    kind: str | None  # "sglang", "vllm", or None: answers HTTP, but neither signature
    version: str | None = None
    model: str | None = None

    def describe(self) -> str:
        if self.kind is None:
            return "an HTTP server that is neither SGLang (/get_model_info) nor vLLM (/v1/models owned_by vllm)"
        return " ".join(p for p in (self.kind, self.version, f"serving {self.model}" if self.model else None) if p)


def check_backend_url(url: str) -> str:
    """``url`` without a trailing slash; raises :class:`BackendURLError` saying what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise BackendURLError(f"--backend-url {url!r} must start with http:// or https:// "
                              f"(e.g. http://127.0.0.1:30000)")
    if not parts.hostname:
        raise BackendURLError(f"--backend-url {url!r} has no host")
    try:
        parts.port  # noqa: B018 (raises for a port that is not a number in 0..65535)
    except ValueError as exc:
        raise BackendURLError(f"--backend-url {url!r}: {exc}") from None
    if parts.query or parts.fragment:
        raise BackendURLError(f"--backend-url {url!r} must not have a query or fragment")
    return url.rstrip("/")


def _get_json(http: requests.Session, url: str, timeout: float) -> Any:
    """The JSON body of a 200 answer, else None (any other HTTP answer: not this route)."""
    resp = http.get(url, timeout=timeout)
    if resp.status_code != 200:
        return None
    try:
        return resp.json()
    except ValueError:
        return None


def identify_engine(url: str, timeout: float = PROBE_TIMEOUT) -> EngineIdentity:
    """What answers at ``url``. Raises :class:`EngineUnreachable` (no connection) or
    ``requests.Timeout`` (a connection, no answer in ``timeout``: see :func:`wait_for_engine`)."""
    base = url.rstrip("/")
    with requests.Session() as http:
        try:
            info = _get_json(http, base + "/get_model_info", timeout)
            if isinstance(info, dict) and "model_path" in info:
                version = _get_json(http, base + "/get_server_info", timeout)
                v = version.get("version") if isinstance(version, dict) else None
                return EngineIdentity("sglang", v if isinstance(v, str) else None, str(info["model_path"]))
            models = _get_json(http, base + "/v1/models", timeout)
            data = models.get("data") if isinstance(models, dict) else None
            cards = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
            if any(card.get("owned_by") == "vllm" for card in cards):
                version = _get_json(http, base + "/version", timeout)
                v = version.get("version") if isinstance(version, dict) else None
                return EngineIdentity("vllm", v if isinstance(v, str) else None, str(cards[0].get("id")))
            return EngineIdentity(None)
        except requests.Timeout:
            raise
        except requests.RequestException as exc:
            raise EngineUnreachable(f"backend {base} unreachable: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    """The OS error inside requests' nested wrappers (``[Errno 111] Connection refused``), else its text."""
    text = str(exc)
    found = re.search(r"\[Errno -?\d+\][^'\")\]]*", text)
    return found.group(0).strip() if found else text


def wait_for_engine(url: str, budget: float, say: Callable[[str], None], *,
                    timeout: float = PROBE_TIMEOUT) -> EngineIdentity:
    """:func:`identify_engine`, waiting up to ``budget`` seconds for an engine that accepts
    connections but does not answer yet; ``say`` gets one line when the wait starts.
    A refused connection fails at once (nothing is starting there)."""
    deadline = time.monotonic() + budget
    said = False
    while True:
        try:
            return identify_engine(url, max(0.2, min(timeout, deadline - time.monotonic())))
        except requests.Timeout:
            if time.monotonic() >= deadline:
                raise EngineNotAnswering(f"backend {url} accepts connections but answered nothing in {budget:.0f} s "
                                         f"(raise --backend-wait if it is still loading)") from None
            if not said:
                say(f"waiting up to {budget:.0f} s for the engine at {url}: it accepts connections but does not "
                    f"answer yet (still loading its model?)")
                said = True


def resolve_kind(configured: str, identity: EngineIdentity, url: str) -> str:
    """The dialect to speak: ``configured``, or for ``auto`` what was found (sglang when nothing
    was). Raises :class:`EngineKindMismatch` when the engine is positively another kind."""
    if configured == "auto":
        # Not identified (a proxy, a router, a test double): miles' wire, today's default; the
        # launcher's line says so. A vLLM is always identified (its /v1/models says vllm).
        return identity.kind or "sglang"
    if identity.kind is not None and identity.kind != configured:
        raise EngineKindMismatch(f"--backend-kind {configured}, but the backend at {url} is {identity.describe()}: "
                                 f"pass --backend-kind {identity.kind} (or auto)")
    return configured


def check_vocabulary(url: str, kind: str, tokenizer: ChatTokenizer, timeout: float = PROBE_TIMEOUT) -> None:
    """Raises :class:`VocabularyMismatch` when the engine's tokenizer is not ``tokenizer``."""
    if kind != "vllm":
        return
    base = url.rstrip("/")
    ours = tokenizer.encode(PROBE_TEXT)
    with requests.Session() as http:
        try:
            resp = http.post(base + "/tokenize", json={"prompt": PROBE_TEXT, "add_special_tokens": False},
                             timeout=timeout)
            theirs = resp.json().get("tokens") if resp.status_code == 200 else None
            if theirs is None:
                return  # an engine without /tokenize: nothing to compare (it is on by default in vLLM)
            if theirs != ours:
                raise VocabularyMismatch(
                    f"the tokenizer ({tokenizer.name}) is not the engine's: {PROBE_TEXT!r} is {len(ours)} ids here "
                    f"and {len(theirs)} on the engine (first difference at id {_first_difference(ours, theirs)}); "
                    f"pass --tokenizer with the model's tokenizer directory")
            top = _largest_id(tokenizer)
            resp = http.post(base + "/detokenize", json={"tokens": [top]}, timeout=timeout)
            if resp.status_code == 400:
                raise VocabularyMismatch(f"the tokenizer ({tokenizer.name}) has id {top}, which the engine does not "
                                         f"know: its vocabulary is smaller; pass the model's tokenizer directory")
        except (requests.RequestException, ValueError, AttributeError) as exc:
            raise EngineUnreachable(f"backend {base}: the tokenizer check failed: {exc}") from None


def _largest_id(tokenizer: ChatTokenizer) -> int:
    size = getattr(tokenizer, "vocab_size", None)
    return int(size) - 1 if isinstance(size, int) and size > 0 else max(tokenizer.encode(PROBE_TEXT))


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
