"""The demo's trajectory files: records stored once, so the output grows linearly with turns.

A session's records (miles' ``SessionRecord``) each repeat the whole conversation: turn k's
``request.input_ids`` and ``request.messages`` hold every earlier turn, and its
``routed_experts`` (base64 int32, one row of ``layers x top_k`` per token) cover every token so
far. Written as they are, an
episode's records grow with the square of its turns (about 6 GB for 8 x 200 turns with R3).

:func:`compact_records` stores what each record adds:

* ``request.input_ids`` -> ``request.input_ids_from_previous: n`` + ``request.input_ids_new``
  when the prompt starts with the previous record's prompt + output (n ids; always, for
  append-only chats);
* ``request.messages`` -> ``request.messages_from_previous: n`` + ``request.messages_new``
  when they start with the previous request's n messages; ``request.image_data`` (the
  images' ``sha256:`` references, one per image so far) likewise, as ``image_data_from_previous``
  + ``image_data_new``;
* each choice's ``meta_info.routed_experts`` -> ``{"file", "offset", "first_row", "rows",
  "row_bytes"}``: the raw rows (int32 LE) for the tokens from ``first_row`` on, appended to a
  binary side file. ``first_row`` is the first token the previous record had no row for, so
  every token's routing is stored once, as recorded by the turn that added the token.

A record whose prompt does not extend the previous one (a rollback) is stored whole.
:func:`expand_records` rebuilds full records (routed experts as base64 again; the prefix
rows taken from the turns that recorded them).
"""

from __future__ import annotations

import base64
import copy
from typing import Any, BinaryIO

__all__ = ["compact_records", "expand_records"]

# Request lists that repeat the previous request's and grow: stored as what each turn adds.
_PREFIXED_LISTS = ("messages", "image_data")


def _prompt(record: dict[str, Any]) -> list[int]:
    return list(record["request"]["input_ids"])


def _output(record: dict[str, Any]) -> list[int]:
    """The first choice's sampled ids, from SGLang's ``[[logprob, token_id, ...], ...]``."""
    choices = _choices(record)
    pairs = (choices[0].get("meta_info") or {}).get("output_token_logprobs") if choices else None
    return [pair[1] for pair in pairs or ()]


def _sequence(record: dict[str, Any]) -> list[int]:
    return _prompt(record) + _output(record)


def _previous(prev: dict[str, Any] | None) -> dict[str, Any]:
    """The previous expanded record, which a compact record's ``*_from_previous`` refers to."""
    if prev is None:
        raise ValueError("the first compact record refers to a previous record")
    return prev


def _choices(record: dict[str, Any]) -> list[dict[str, Any]]:
    response = record.get("response")
    return response.get("choices", []) if isinstance(response, dict) else []


def compact_records(records: list[dict[str, Any]], r3_file: BinaryIO, r3_name: str) -> list[dict[str, Any]]:
    """``records`` as written to trajectories.jsonl; routed-expert rows go to ``r3_file``
    (named ``r3_name`` in the records), appended at its current position."""
    out: list[dict[str, Any]] = []
    prev: dict[str, Any] | None = None
    for record in records:
        rec = copy.deepcopy(record)
        prompt = _prompt(record)
        extends = prev is not None and prompt[: len(_sequence(prev))] == _sequence(prev)
        request, prev_request = rec["request"], (prev or {}).get("request")
        if extends:
            assert prev is not None  # extends says so
            n = len(_sequence(prev))
            del request["input_ids"]
            request["input_ids_from_previous"], request["input_ids_new"] = n, prompt[n:]
        for key in _PREFIXED_LISTS:
            if (isinstance(request, dict) and isinstance(prev_request, dict)
                    and isinstance(request.get(key), list) and isinstance(prev_request.get(key), list)):
                n = len(prev_request[key])
                if request[key][:n] == prev_request[key]:
                    request[f"{key}_from_previous"], request[f"{key}_new"] = n, request.pop(key)[n:]
        # rows the previous record already stored: its prompt + output, less the last output token
        # (never fed back, so it has no routing)
        first_row = len(_sequence(prev)) - 1 if extends and prev is not None else 0  # extends: prev is set
        for choice in _choices(rec):
            meta = choice.get("meta_info") or {}
            if not isinstance(meta.get("routed_experts"), str):
                continue
            raw = base64.b64decode(meta["routed_experts"])
            rows = len(prompt) + int(meta.get("completion_tokens", len(_output(record)))) - 1
            row_bytes = len(raw) // rows if rows > 0 else 0
            start = min(first_row, rows) if row_bytes else 0
            offset = r3_file.tell()
            r3_file.write(raw[start * row_bytes:])
            meta["routed_experts"] = {"file": r3_name, "offset": offset, "first_row": start,
                                      "rows": rows - start if row_bytes else 0, "row_bytes": row_bytes,
                                      "bytes": len(raw) - start * row_bytes}
        out.append(rec)
        prev = record
    return out


def expand_records(compact: list[dict[str, Any]], r3_data: bytes) -> list[dict[str, Any]]:
    """The inverse of :func:`compact_records` (``r3_data``: the side file's bytes)."""
    out: list[dict[str, Any]] = []
    prev_rows: dict[int, bytes] = {}  # choice index -> that choice's full rows, previous record
    for rec in compact:
        full = copy.deepcopy(rec)
        prev = out[-1] if out else None
        request = full.get("request")
        if isinstance(request, dict) and "input_ids_from_previous" in request:
            n = request.pop("input_ids_from_previous")
            request["input_ids"] = _sequence(_previous(prev))[:n] + request.pop("input_ids_new")
        for key in _PREFIXED_LISTS:
            if isinstance(request, dict) and f"{key}_from_previous" in request:
                n = request.pop(f"{key}_from_previous")
                request[key] = _previous(prev)["request"][key][:n] + request.pop(f"{key}_new")
        rows_now: dict[int, bytes] = {}
        for i, choice in enumerate(_choices(full)):
            meta = choice.get("meta_info") or {}
            ref = meta.get("routed_experts")
            if not isinstance(ref, dict):
                continue
            new = r3_data[ref["offset"]: ref["offset"] + ref["bytes"]]
            prefix = prev_rows.get(0, b"")[: ref["first_row"] * ref["row_bytes"]]
            rows_now[i] = prefix + new
            meta["routed_experts"] = base64.b64encode(rows_now[i]).decode("ascii")
        prev_rows = rows_now or prev_rows
        out.append(full)
    return out
