"""What the viewer reads of a session core: summaries, a compact timeline, images by sha256.

The worker (``webapp.worker``, ops ``viewer_*`` of :class:`webapp.ipc.Op`) and the single-process
app both answer the viewer through one :class:`ViewerData` over their ``SessionCore``, so the
shapes cannot drift; the summary's fields are :data:`webapp.viewer_shape.SUMMARY_FIELDS`.

The timeline is built for a browser, not for training: per turn the messages the model got
that turn (images as sha256 references), its reply, the parsed action, finish reason and
latency; then the final sequence's tokens, each with its kind (observation / trained model
token / model token outside the sample), logprob and text (decoded once per distinct id with
the session's tokenizer), every image pad run collapsed to one entry naming its image. It
never carries the records' ``input_ids``, image bytes or replay payloads: each record is read
from the journal with those byte spans cut out before parsing (the ids dominate a long
session's records: they grow with every turn). Built once per journal version (cached).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from webapp.core import Reply, Session, SessionCore, error_reply, error_response, json_response
from webapp.samples import TurnRecord, assemble_samples
from webapp.session_errors import SampleAssemblyError, SessionError
from webapp.tito import MAX_TRIM_TOKENS
from webapp.tokenizers import ChatTokenizer
from webapp.viewer_shape import SUMMARY_FIELDS

__all__ = ["KIND_MASKED", "KIND_TRAINED", "KIND_UNTRAINED", "ViewerData", "parse_action", "session_summary"]

# Token kinds in the timeline's ``tokens.kinds`` string (one character per entry).
KIND_MASKED = "0"  # prompt / observation: loss mask 0
KIND_TRAINED = "1"  # a model token /samples trains on: loss mask 1
KIND_UNTRAINED = "2"  # a model token the sample leaves out (after a truncated or cut turn)
_CACHE_SIZE = 8  # timelines kept per core (each a few MiB at most)
_INPUT_IDS = b'"input_ids":['


def session_summary(session: Session) -> dict[str, Any]:
    """The list's row for one session (``instance`` is the HTTP side's to add)."""
    records, state, rollbacks, _version = session.snapshot()
    row = {"session_id": session.session_id, "turns": len(records), "tokens": len(state.token_ids),
           "images": len(session.images), "rollbacks": rollbacks, "created": session.created_at,
           "last_turn": records[-1].timestamp if records else None,
           "status": "running" if session.turn_lock.locked() else "idle"}
    assert set(row) | {"instance"} == set(SUMMARY_FIELDS), "the summary shape is declared in viewer_shape"
    return row


def parse_action(message: dict[str, Any]) -> dict[str, Any] | None:
    """The action a reply names: its first tool call (name + arguments) or the reference
    backend's ``{"action": {...}}`` text; None when it names none."""
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls and isinstance(calls[0], dict):
        function = calls[0].get("function") or {}
        arguments: Any = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        return {"tool": function.get("name"), "arguments": arguments}
    content = message.get("content")
    if isinstance(content, str) and content.lstrip().startswith("{"):
        try:
            parsed = json.loads(content)
        except ValueError:
            return None
        if isinstance(parsed, dict) and isinstance(parsed.get("action"), dict):
            return dict(parsed["action"])
    return None


def _parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as ``[{"text": ...} | {"image": sha256}]``."""
    if isinstance(content, str):
        return [{"text": content}]
    out: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else ():
        if not isinstance(part, dict):
            continue
        if part.get("type") == "text":
            out.append({"text": str(part.get("text", ""))})
        elif part.get("type") == "image_url":
            url = str((part.get("image_url") or {}).get("url", ""))
            out.append({"image": url.removeprefix("sha256:")})
    return out


def _message(m: Any) -> dict[str, Any]:
    if not isinstance(m, dict):
        return {"role": "?", "parts": []}
    out: dict[str, Any] = {"role": str(m.get("role", "?")), "parts": _parts(m.get("content"))}
    if m.get("name"):
        out["name"] = str(m["name"])
    if m.get("tool_call_id"):
        out["tool_call_id"] = str(m["tool_call_id"])
    calls = m.get("tool_calls")
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [{"name": (c.get("function") or {}).get("name"),
                              "arguments": (c.get("function") or {}).get("arguments")}
                             for c in calls if isinstance(c, dict)]
    return out


def _load_record(turn: TurnRecord) -> dict[str, Any]:
    """The record's JSON without its input ids and replay payloads (cut before parsing)."""
    assert turn.record is not None, "a committed record is in the journal"
    data = turn.record.read()
    cuts = [(s, e) for s, e in turn.replay.values()]  # base64 text inside "...": left as ""
    start = data.find(_INPUT_IDS)
    if start >= 0:
        start += len(_INPUT_IDS)
        end = data.find(b"]", start)  # integers only: the first ']' closes the array
        if end > start:
            cuts.append((start, end))
    pieces, at = [], 0
    for s, e in sorted(cuts):
        if s < at:
            continue
        pieces.append(data[at:s])
        at = e
    pieces.append(data[at:])
    try:
        parsed = json.loads(b"".join(pieces))
    except ValueError:  # a cut in the wrong place (an odd client field): parse it whole
        parsed = json.loads(data)
    return parsed if isinstance(parsed, dict) else {}


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _token_text(tokenizer: ChatTokenizer, tid: int) -> str:
    try:
        return tokenizer.decode([tid])
    except (UnicodeDecodeError, ValueError):
        return f"<0x{tid:02X}>" if 0 <= tid < 256 else f"<{tid}>"  # part of a multi-byte character


class ViewerData:
    """The viewer's reads of one session core; every method returns a ``webapp.core.Reply``."""

    def __init__(self, core: SessionCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], bytes] = OrderedDict()

    def sessions(self, prefix: str = "") -> Reply:
        """``{"sessions": [summary...]}`` of every session whose id starts with ``prefix``."""
        self._core.expiry.sweep()
        rows = []
        for session_id in list(self._core.registry.ids()):
            if not session_id.startswith(prefix):
                continue
            try:
                rows.append(session_summary(self._core.registry.peek(session_id)))
            except SessionError:  # deleted meanwhile
                continue
        return json_response(200, {"sessions": rows})

    def summary(self, session_id: str) -> Reply:
        try:
            return json_response(200, session_summary(self._core.registry.peek(session_id)))
        except SessionError as exc:
            return error_reply(exc)

    def image(self, session_id: str, sha256: str) -> Reply:
        """One image's bytes; cacheable for good (content-addressed)."""
        try:
            session = self._core.registry.peek(session_id)
        except SessionError as exc:
            return error_reply(exc)
        image = session.images.get(sha256)
        if image is None:
            return error_response(404, f"session {session_id} has no image {sha256[:64]}")
        return Reply(200, image.data, content_type=image.mime_type,
                     headers=(("Cache-Control", "private, max-age=31536000, immutable"),))

    def timeline(self, session_id: str) -> Reply:
        try:
            session = self._core.registry.peek(session_id)
        except SessionError as exc:
            return error_reply(exc)
        records, state, rollbacks, version = session.snapshot()
        key = (session_id, version)
        with self._lock:
            body = self._cache.get(key)
            if body is not None:
                self._cache.move_to_end(key)
        if body is None:
            body = json.dumps(self._build(session, records, state.token_ids, rollbacks),
                              separators=(",", ":"), ensure_ascii=False).encode()
            with self._lock:
                self._cache[key] = body
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return Reply(200, body)

    def _build(self, session: Session, records: Sequence[TurnRecord], ids: Sequence[int],
               rollbacks: int) -> dict[str, Any]:
        tokenizer = self._core.tokenizer
        turns = []
        seen = 0  # messages of the previous turn's request, plus its reply
        for i, record in enumerate(records):
            parsed = _load_record(record)
            request, response = _dict(parsed.get("request")), _dict(parsed.get("response"))
            messages, choices = _list(request.get("messages")), _list(response.get("choices"))
            reply = _dict(_dict(choices[0]).get("message")) if choices else {}
            finish = record.finish_reason
            turns.append({
                "index": i,
                "rollback": bool(parsed.get("rollback")),
                "messages": [_message(m) for m in messages[seen:]],
                "context_messages": min(seen, len(messages)),
                "reply": _message(reply),
                "action": parse_action(reply),
                "finish_reason": finish.get("type") if isinstance(finish, dict) else finish,
                "latency": round(record.timestamp - record.request_timestamp, 4),
                "timestamp": record.timestamp,
                "prompt_tokens": record.prompt_len,
                "output_tokens": len(record.output_ids),
                "images": list(record.images),
            })
            seen = len(messages) + 1
        images = {sha: {"mime_type": im.mime_type, "width": im.width, "height": im.height}
                  for sha, im in list(session.images.items())}
        return {"session_id": session.session_id, "summary": session_summary(session),
                "tokenizer": getattr(tokenizer, "name", type(tokenizer).__name__), "rollbacks": rollbacks,
                "turns": turns, "images": images, **self._tokens(records, ids)}

    def _tokens(self, records: Sequence[TurnRecord], ids: Sequence[int]) -> dict[str, Any]:
        """The final sequence for the token view, and what /samples trains on of it."""
        tokenizer = self._core.tokenizer
        n = len(ids)
        kinds = bytearray(KIND_MASKED.encode() * n)
        logprobs: list[float | None] = [None] * n
        for record in records:  # every model token of the current branch, with its logprob
            for j, (tid, lp) in enumerate(zip(record.output_ids, record.logprobs)):
                pos = record.prompt_len + j
                if pos >= n or ids[pos] != tid:
                    break
                kinds[pos] = ord(KIND_UNTRAINED)
                logprobs[pos] = round(float(lp), 4)
        sample_info: dict[str, Any]
        try:
            samples, empty_reason = assemble_samples(records, ids, tokenizer, max_seq_len=None,
                                                     max_trim_tokens=MAX_TRIM_TOKENS)
        except SampleAssemblyError as exc:
            samples, empty_reason = [], f"assembly failed: {exc}"
        if samples:
            sample = samples[0]
            prompt = len(sample.tokens) - sample.response_length
            for j, mask in enumerate(sample.loss_mask):
                if mask and prompt + j < n:
                    kinds[prompt + j] = ord(KIND_TRAINED)
            sample_info = {"status": sample.status, "tokens": len(sample.tokens), "prompt_length": prompt,
                           "response_length": sample.response_length, "trained_tokens": sum(sample.loss_mask)}
        else:
            sample_info = {"status": None, "empty_reason": empty_reason, "tokens": 0, "trained_tokens": 0}
        # Image pad runs collapse to one entry each: -(k + 1) names image_runs[k]; the k-th run is
        # the k-th image of the last prompt (which holds every image of the branch, in order).
        vision = getattr(tokenizer, "vision", None)
        order = records[-1].images if records else ()
        out_ids: list[int] = []
        out_kinds = bytearray()
        out_lp: list[float | None] = []
        runs: list[dict[str, Any]] = []
        i = 0
        while i < n:
            tid = ids[i]
            if vision is not None and tid == vision.pad_id:
                j = i
                while j < n and ids[j] == tid:
                    j += 1
                k = len(runs)
                runs.append({"start": i, "count": j - i, "sha256": order[k] if k < len(order) else None})
                out_ids.append(-(k + 1))
                out_kinds.append(kinds[i])
                out_lp.append(None)
                i = j
                continue
            out_ids.append(tid)
            out_kinds.append(kinds[i])
            out_lp.append(logprobs[i])
            i += 1
        vocab = {str(t): _token_text(tokenizer, t) for t in set(out_ids) if t >= 0}
        turn_starts = [r.prompt_len for r in records]
        return {"tokens": {"length": n, "ids": out_ids, "kinds": out_kinds.decode(), "logprobs": out_lp,
                           "vocab": vocab, "image_runs": runs, "turn_starts": turn_starts},
                "sample": sample_info}
