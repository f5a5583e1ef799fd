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
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from webapp.core import Reply, Session, SessionCore, error_reply, error_response, json_response
from webapp.filebody import read_pieces, slice_pieces
from webapp.offload import run_blocking
from webapp.records import Text
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
log = logging.getLogger(__name__)

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


def _ids_json_lengths(ids: Sequence[int]) -> np.ndarray:
    """``out[p]``: the bytes of ``ids[:p]`` as the core's JSON writes them (``1,22,333``)."""
    arr = np.asarray(ids, dtype=np.int64)
    digits = np.ones(len(arr), dtype=np.int64)
    for power in range(1, 19):  # exact: no floating-point logarithm
        digits += arr >= 10 ** power
    out = np.zeros(len(arr) + 1, dtype=np.int64)
    np.cumsum(digits + 1, out=out[1:])
    out[1:] -= 1  # a comma between ids, none before the first
    return out


def _load_record(turn: TurnRecord, ids_bytes: int) -> dict[str, Any]:
    """The record's JSON without its input ids and replay payloads, which are never read.

    The ids are the one part that grows with the session (every record repeats the whole
    prompt). A record of journal format 2 keeps them (and each replay payload) as a field of
    its own, left out here (``"input_ids":[]``, ``""``); a format-1 record is one text whose ids
    are skipped by length: ``ids_bytes``, computed from the session's accumulated ids (the
    prompt is their prefix), and whose replay payloads are cut at their spans."""
    body = turn.record
    assert body is not None, "a committed record is in the journal"
    if not body.v1_replay and not (len(body.fields) == 1 and isinstance(body.fields[0], Text)):
        return _parsed(read_pieces([p for f in body.fields if isinstance(f, Text) for p in f.pieces]))
    (whole,) = (f for f in body.fields if isinstance(f, Text))
    pieces, length = whole.pieces, whole.length
    head, want = b"", 64 << 10
    at = -1
    while at < 0 and len(head) < length:
        head = read_pieces(slice_pieces(pieces, 0, min(length, want)))
        at = head.find(_INPUT_IDS)
        want *= 4
    if at < 0:  # a record without ids (never written by this core): parse what is there
        return _parsed(head)
    ids_end = at + len(_INPUT_IDS) + ids_bytes
    kept, pos = [head[:at + len(_INPUT_IDS)]], ids_end
    for s, e in sorted(body.v1_replay.values()):  # base64 text inside "...": left as ""
        if s >= pos:
            kept.append(read_pieces(slice_pieces(pieces, pos, s)))
            pos = e
    kept.append(read_pieces(slice_pieces(pieces, pos, length)))
    if not kept[1].startswith(b"]"):  # not where the length says (an odd client field): read it all
        return _parsed(read_pieces(pieces))
    return _parsed(b"".join(kept))


def _parsed(data: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(data)
    except ValueError:
        return {}
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
        self._building: dict[tuple[str, str], Future[bytes]] = {}  # builds in flight, by key

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
                return Reply(200, body)
            building = self._building.get(key)
            owner = building is None
            if building is None:
                building = self._building[key] = Future()
        if not owner:  # another viewer asked first: wait for that build, never a second one
            if building.exception() is not None:  # waits for it; the builder logged why
                return error_response(500, "building the timeline failed (logged)")
            return Reply(200, building.result())
        try:
            # Up to a second of CPU for a long session: in a thread, so the worker's other
            # requests (chats) keep running meanwhile (webapp.offload).
            body = run_blocking("viewer", self._encoded, session, records, state.token_ids, rollbacks)
        except Exception as exc:  # a bug here must cost this page only
            log.exception("timeline of session %s failed", session_id)
            building.set_exception(exc)
            return error_response(500, "building the timeline failed (logged)")
        finally:
            with self._lock:
                del self._building[key]
        with self._lock:
            self._cache[key] = body
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        building.set_result(body)
        return Reply(200, body)

    def _encoded(self, session: Session, records: Sequence[TurnRecord], ids: Sequence[int], rollbacks: int) -> bytes:
        return json.dumps(self._build(session, records, ids, rollbacks), separators=(",", ":"),
                          ensure_ascii=False).encode()

    def _build(self, session: Session, records: Sequence[TurnRecord], ids: Sequence[int],
               rollbacks: int) -> dict[str, Any]:
        tokenizer = self._core.tokenizer
        turns = []
        seen = 0  # messages of the previous turn's request, plus its reply
        ids_bytes = _ids_json_lengths(ids)
        for i, record in enumerate(records):
            parsed = _load_record(record, int(ids_bytes[min(record.prompt_len, len(ids))]))
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
            })
            seen = len(messages) + 1
        images = {sha: {"mime_type": im.mime_type, "width": im.width, "height": im.height}
                  for sha, im in list(session.images.items())}
        return {"session_id": session.session_id, "summary": session_summary(session),
                "tokenizer": getattr(tokenizer, "name", type(tokenizer).__name__), "rollbacks": rollbacks,
                "turns": turns, "images": images, **self._tokens(records, ids)}

    def _tokens(self, records: Sequence[TurnRecord], ids: Sequence[int]) -> dict[str, Any]:
        """The final sequence for the token view, and what /samples trains on of it (numpy:
        a long session has ~10^5-10^6 tokens, most of them image pads)."""
        tokenizer = self._core.tokenizer
        arr = np.asarray(ids, dtype=np.int64)
        n = len(arr)
        kinds = np.full(n, ord(KIND_MASKED), dtype=np.uint8)
        logprobs = np.full(n, np.nan)
        for record in records:  # every model token of the current branch, with its logprob
            out = np.asarray(record.output_ids, dtype=np.int64)
            seg = arr[record.prompt_len:record.prompt_len + len(out)]
            differ = np.flatnonzero(seg != out[:len(seg)])
            m = int(differ[0]) if len(differ) else len(seg)
            kinds[record.prompt_len:record.prompt_len + m] = ord(KIND_UNTRAINED)
            logprobs[record.prompt_len:record.prompt_len + m] = np.asarray(record.logprobs[:m], dtype=float)
        sample_info: dict[str, Any]
        try:
            samples, empty_reason = assemble_samples(records, ids, tokenizer, max_seq_len=None,
                                                     max_trim_tokens=MAX_TRIM_TOKENS)
        except SampleAssemblyError as exc:
            samples, empty_reason = [], f"assembly failed: {exc}"
        if samples:
            sample = samples[0]
            prompt = len(sample.tokens) - sample.response_length
            trained = prompt + np.flatnonzero(np.asarray(sample.loss_mask, dtype=bool))
            kinds[trained[trained < n]] = ord(KIND_TRAINED)
            sample_info = {"status": sample.status, "tokens": len(sample.tokens), "prompt_length": prompt,
                           "response_length": sample.response_length, "trained_tokens": len(trained)}
        else:
            sample_info = {"status": None, "empty_reason": empty_reason, "tokens": 0, "trained_tokens": 0}
        # Image pad runs collapse to one entry each: -(k + 1) names image_runs[k]; the k-th run is
        # the k-th image of the last prompt (which holds every image of the branch, in order).
        vision = getattr(tokenizer, "vision", None)
        order = records[-1].images if records else ()
        is_pad = arr == vision.pad_id if vision is not None else np.zeros(n, dtype=bool)
        run_start = is_pad & ~np.concatenate(([False], is_pad[:-1]))
        run_end = is_pad & ~np.concatenate((is_pad[1:], [False]))
        starts, ends = np.flatnonzero(run_start), np.flatnonzero(run_end) + 1
        keep = ~is_pad | run_start
        entries = arr.copy()
        entries[starts] = -(np.arange(len(starts)) + 1)
        runs = [{"start": int(a), "count": int(b - a), "sha256": order[k] if k < len(order) else None}
                for k, (a, b) in enumerate(zip(starts, ends))]
        out_ids = entries[keep]
        kept = np.round(logprobs[keep], 4)
        # JSON null: no logprob (not a model token)
        out_lp = [None if missing else v for missing, v in zip(np.isnan(kept).tolist(), kept.tolist())]
        vocab = {str(t): _token_text(tokenizer, t) for t in np.unique(out_ids[out_ids >= 0]).tolist()}
        return {"tokens": {"length": n, "ids": out_ids.tolist(), "kinds": kinds[keep].tobytes().decode(),
                           "logprobs": out_lp, "vocab": vocab, "image_runs": runs,
                           "turn_starts": [r.prompt_len for r in records]},
                "sample": sample_info}
