"""Training samples from a session's records, and miles' samples wire format.

``POST /sessions/{id}/samples`` answers what miles main assembles on its session server
(``miles/rollout/session/samples/merge.py`` + ``generate_utils/sample_utils.merge_samples``),
encoded so that miles' ``decode_samples_and_merge_input_sample`` reads it unchanged
(``samples/codec.py``). The rules, as miles applies them:

1. One sample per record: ``tokens`` = the record's prompt ids + output ids, ``loss_mask`` =
   1 per output token, ``rollout_log_probs`` = the output logprobs, ``response`` = the decoded
   output, ``status`` from ``finish_reason`` (stop/tool_calls: completed, length: truncated,
   abort: aborted, else pending), ``prefix_cache_info`` from ``cached_tokens`` /
   ``prompt_tokens``, ``weight_versions`` from ``weight_version``, and
   ``metadata["lifecycle"]`` (``t0``/``t1``/``turn``/``req_ts``/``prev_t1``); with images,
  ``metadata["images"]``: the ``sha256:`` references of the prompt's images in order (ours;
  a merged sample keeps the last one's, which covers all of its tokens). Output tokens
   the next prompt does not carry are trimmed (at most ``max_trim_tokens`` on a non-last
   turn, none on the last); every accumulated id must be consumed.
2. ``max_seq_len``: the first sample over the budget is cut to it (status truncated) and
   later ones are dropped; a sample with no output left ends the list there.
3. Merge, left to right, while the merged sample is completed and the next one does not lose
   a replay payload the merged one has: the tokens between two turns (tool/user messages and
   template glue) get loss mask 0 and logprob 0.0, responses and lengths add up, the last
   sample's status, R3 and indexer top-k win.

R3 (``rollout_routed_experts``) is int32 of shape ``(len(tokens) - 1, layers, top_k)``;
``layers`` is the routing-replay setting (miles' ``--num-layers``), ``top_k`` follows from the
payload's size. Only the final sample's R3 is decoded — one record's payload, never all of
them. Our TITO never drops an output token (see ``webapp.tito``), so ``max_trim_tokens`` is 0
and each record's prompt ids are a prefix of the accumulated ids: the records keep no second
copy of them.

Wire format (one safetensors payload): per sample ``i`` the tensors ``<field>.<i>`` of
:data:`WIRE_FIELDS` with their pinned dtypes (a None tensor field is listed in the sample's
``nulls`` instead), and one uint8 tensor ``_samples_meta`` holding the JSON
``{"samples": [{<json fields>, "nulls": [...]}], "session_metadata": {...}, "empty_reason": ...}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import safetensors.numpy

from webapp.records import RecordBody
from webapp.session_errors import SampleAssemblyError
from webapp.tokenizers import ChatTokenizer, decode_lenient

__all__ = [
    "IMAGE_TENSOR_PREFIX",
    "META_KEY",
    "WIRE_FIELDS",
    "Sample",
    "TurnRecord",
    "assemble_samples",
    "encode_samples",
]

META_KEY = "_samples_meta"
IMAGE_TENSOR_PREFIX = "image."  # + sha256: one image's file bytes (``?images=1``)
# The samples wire of miles' v1 server: field -> numpy dtype of its tensor, or None for a
# field carried in the JSON meta. Order is miles'.
WIRE_FIELDS: dict[str, np.dtype | None] = {
    "tokens": np.dtype(np.int64),
    "response": None,
    "response_length": None,
    "loss_mask": np.dtype(np.uint8),
    "rollout_log_probs": np.dtype(np.float64),
    "rollout_routed_experts": np.dtype(np.int32),
    "rollout_indexer_topk": np.dtype(np.int32),
    "status": None,
    "weight_versions": None,
    "prefix_cache_info": None,
    "metadata": None,
}
_STATUS_BY_FINISH = {"stop": "completed", "tool_calls": "completed", "length": "truncated", "abort": "aborted"}
# Small meta_info fields a sample reads; kept per record so assembly never re-parses a reply.
SAMPLE_META_KEYS = ("cached_tokens", "prompt_tokens", "weight_version", "e2e_latency", "indexer_topk_num_layers")
R3_FIELD = {"routed_experts": "rollout_routed_experts", "indexer_topk": "rollout_indexer_topk"}


@dataclass(frozen=True)
class TurnRecord:
    """What assembly needs of one committed record, besides its bytes."""

    prompt_len: int  # len(request.input_ids); the ids are accumulated_token_ids[:prompt_len]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: Any
    meta: dict[str, Any]  # SAMPLE_META_KEYS present in choices[0].meta_info
    timestamp: float
    request_timestamp: float
    replay: tuple[str, ...]  # the replay keys the record holds (its payloads: ``record.replay(key)``)
    images: tuple[str, ...] = ()  # sha256 of each image in the prompt, in order of appearance
    record: RecordBody | None = None  # the record's bytes in the session journal (None: not written yet)


@dataclass
class _Replay:
    """A replay payload not decoded yet: ``source``'s (record ``turn`` of its sample's
    records), first ``rows`` rows kept. It names its record itself, so samples of several
    record lists (a tree session's leaves) encode into one payload."""

    turn: int
    rows: int
    source: TurnRecord


@dataclass
class Sample:
    # A prefix of the session's accumulated ids (a view of them, not a copy: per-turn samples
    # of a long session would otherwise copy the conversation once per turn).
    tokens: np.ndarray
    response: str
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    status: str
    replay: dict[str, _Replay] = field(default_factory=dict)  # R3_FIELD values -> payload
    weight_versions: list[str] = field(default_factory=list)
    prefix_cache_info: dict[str, int] = field(default_factory=lambda: {"cached_tokens": 0,
                                                                       "total_prompt_tokens": 0})
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: Any = None  # miles' Sample.reward: on the wire of tree sessions only (WIRE_FIELDS_V2)

    def strip_last_output_tokens(self, n: int, tokenizer: ChatTokenizer) -> None:
        if n <= 0:
            return
        self.tokens = self.tokens[:-n]
        self.response_length -= n
        self.loss_mask = self.loss_mask[:-n]
        self.rollout_log_probs = self.rollout_log_probs[:-n]
        self.response = (decode_lenient(tokenizer, self.tokens[-self.response_length:].tolist())
                         if self.response_length > 0 else "")
        for payload in self.replay.values():
            payload.rows = max(0, payload.rows - n)


def _turn_sample(i: int, turns: Sequence[TurnRecord], accumulated: np.ndarray,
                 tokenizer: ChatTokenizer) -> Sample:
    turn = turns[i]
    output = list(turn.output_ids)
    out = np.asarray(output, dtype=np.int64)
    end = turn.prompt_len + len(out)
    # The prompt + output as a view of the accumulated ids when the output is in them (every
    # turn but one whose tail was trimmed, rare); else a copy.
    tokens = (accumulated[:end] if end <= len(accumulated) and np.array_equal(accumulated[turn.prompt_len:end], out)
              else np.concatenate((accumulated[:turn.prompt_len], out)))
    sample = Sample(tokens=tokens, response=decode_lenient(tokenizer, output), response_length=len(output),
                    loss_mask=[1] * len(output), rollout_log_probs=list(turn.logprobs),
                    status=_STATUS_BY_FINISH.get(turn.finish_reason, "pending"))
    for key in turn.replay:
        sample.replay[R3_FIELD[key]] = _Replay(i, len(tokens) - 1, turn)
    meta = turn.meta
    sample.prefix_cache_info = {"cached_tokens": meta.get("cached_tokens", 0),
                                "total_prompt_tokens": meta.get("prompt_tokens", 0)}
    if "weight_version" in meta:
        sample.weight_versions.append(meta["weight_version"])
    latency = meta.get("e2e_latency")
    segment: dict[str, Any] = {"t0": turn.timestamp - latency if latency is not None else None,
                               "t1": turn.timestamp, "turn": i + 1, "req_ts": turn.request_timestamp}
    if i:
        segment["prev_t1"] = turns[i - 1].timestamp
    sample.metadata["lifecycle"] = segment
    if turn.images:  # the images of the prompt, in order: one pad run each in ``tokens``
        sample.metadata["images"] = [f"sha256:{digest}" for digest in turn.images]
    return sample


def _per_turn_samples(turns: Sequence[TurnRecord], accumulated: Sequence[int], max_trim_tokens: int,
                      tokenizer: ChatTokenizer) -> list[Sample]:
    samples = []
    cursor = 0
    ids = np.asarray(accumulated, dtype=np.int64)
    for i, turn in enumerate(turns):
        is_last = i == len(turns) - 1
        if turn.prompt_len > len(accumulated):
            raise SampleAssemblyError(f"record {i}: prompt of {turn.prompt_len} tokens is longer than the "
                                      f"{len(accumulated)} accumulated tokens")
        cursor = turn.prompt_len
        matched = 0
        for j, tid in enumerate(turn.output_ids):
            if cursor + j < len(accumulated) and accumulated[cursor + j] == tid:
                matched += 1
            else:
                break
        trim = len(turn.output_ids) - matched
        allowed = 0 if is_last else max_trim_tokens
        if trim > allowed:
            raise SampleAssemblyError(f"trim_count {trim} exceeds allowed={allowed} (is_last={is_last}, "
                                      f"max_trim_tokens={max_trim_tokens}) at record {i}")
        cursor += matched
        sample = _turn_sample(i, turns, ids, tokenizer)
        sample.strip_last_output_tokens(trim, tokenizer)
        samples.append(sample)
    if cursor != len(accumulated):
        raise SampleAssemblyError(f"cursor {cursor} != len(accumulated_token_ids) {len(accumulated)} "
                                  f"after processing all {len(turns)} records")
    return samples


def _truncate(samples: list[Sample], max_seq_len: int, tokenizer: ChatTokenizer) -> list[Sample]:
    kept = []
    for sample in samples:
        overshoot = len(sample.tokens) - max_seq_len
        if overshoot <= 0:
            kept.append(sample)
            continue
        if sample.response_length - overshoot > 0:
            sample.strip_last_output_tokens(overshoot, tokenizer)
            sample.status = "truncated"
            kept.append(sample)
        break
    return kept


def _lifecycle(metadata: dict[str, Any]) -> list[Any]:
    value = metadata.get("lifecycle")
    return [] if value is None else value if isinstance(value, list) else [value]


def _merge(samples: list[Sample], tokenizer: ChatTokenizer) -> Sample:
    """miles' merge of a sample pair (``b`` extends ``a``: the observation between them joins
    the response, loss mask 0, logprob 0.0) applied left to right, in one pass: the lists and
    the response grow in place, where merging pair by pair copies them once per turn."""
    first = last = samples[0]
    response, response_length = [first.response], first.response_length
    loss_mask, logprobs = list(first.loss_mask), list(first.rollout_log_probs)
    weight_versions, cache = list(first.weight_versions), dict(first.prefix_cache_info)
    lifecycle = list(_lifecycle(first.metadata))
    for sample in samples[1:]:
        # Only a completed turn is extended; a turn that lost a replay payload ends it too.
        if last.status != "completed" or any(k not in sample.replay for k in last.replay):
            break
        done = len(last.tokens)
        gap = len(sample.tokens) - done - sample.response_length
        if not np.array_equal(sample.tokens[:done], last.tokens):
            raise SampleAssemblyError("b.tokens must start with a.tokens")
        if gap <= 0:
            raise SampleAssemblyError(f"obs_len must be > 0, got {gap}")
        response += [decode_lenient(tokenizer, sample.tokens[done:done + gap].tolist()), sample.response]
        response_length += gap + sample.response_length
        loss_mask += [0] * gap
        loss_mask += sample.loss_mask
        logprobs += [0.0] * gap
        logprobs += sample.rollout_log_probs
        weight_versions += sample.weight_versions
        cache = {k: cache[k] + sample.prefix_cache_info[k] for k in cache}
        lifecycle += _lifecycle(sample.metadata)
        last = sample
    if last is first:
        return first
    metadata = {k: v for k, v in last.metadata.items() if k != "lifecycle"}
    metadata["lifecycle"] = lifecycle
    return replace(last, response="".join(response), response_length=response_length, loss_mask=loss_mask,
                   rollout_log_probs=logprobs, weight_versions=weight_versions, prefix_cache_info=cache,
                   metadata=metadata)


def assemble_samples(turns: Sequence[TurnRecord], accumulated: Sequence[int], tokenizer: ChatTokenizer, *,
                     max_seq_len: int | None, max_trim_tokens: int = 0) -> tuple[list[Sample], str | None]:
    """The session's training samples (zero or one) and, when there are none, why.

    Raises :class:`SampleAssemblyError` when the records break a rule above.
    """
    if not turns:
        return [], "no_records"
    samples = _per_turn_samples(turns, accumulated, max_trim_tokens, tokenizer)
    if max_seq_len is not None:
        samples = _truncate(samples, max_seq_len, tokenizer)
        if not samples:
            return [], "all_truncated"
    return [_merge(samples, tokenizer)], None


def _replay_tensor(name: str, payload: _Replay, layers: int) -> np.ndarray:
    turn = payload.source
    key = next(k for k, v in R3_FIELD.items() if v == name)
    if key == "indexer_topk":
        layers = turn.meta.get("indexer_topk_num_layers") or 0
        if not layers:
            raise SampleAssemblyError(f"record {payload.turn} has indexer_topk without indexer_topk_num_layers")
    elif layers <= 0:
        raise SampleAssemblyError("routed_experts in the records but no routing-replay layer count is set "
                                  "(--routing-replay-layers)")
    assert turn.record is not None, "a committed record is in the journal"
    values = np.frombuffer(turn.record.replay(key), dtype="<i4").astype(np.int32, copy=False)
    rows = turn.prompt_len + len(turn.output_ids) - 1
    if rows <= 0:
        return np.empty((0, layers, 0), dtype=np.int32)
    if values.size % (rows * layers):
        raise SampleAssemblyError(f"record {payload.turn}: {key} holds {values.size} ids, not a multiple of "
                                  f"{rows} tokens x {layers} layers")
    return values.reshape(rows, layers, -1)[:payload.rows]


def encode_samples(samples: Sequence[Sample], session_metadata: dict[str, Any], empty_reason: str | None, *,
                   routing_replay_layers: int, images: Sequence[Any] | None = None,
                   fields: Mapping[str, np.dtype | None] = WIRE_FIELDS) -> bytes:
    """One safetensors payload in miles' samples wire format (see the module docstring);
    ``images`` (``webapp.images.DecodedImage``): each also as a uint8 tensor ``image.<sha256>``
    (the file's bytes), described in the meta's ``images``. ``fields``: the wire's field table
    (v1's :data:`WIRE_FIELDS`; tree sessions add ``reward``, ``webapp.tree_samples``)."""
    tensors: dict[str, np.ndarray] = {}
    metas = []
    for i, sample in enumerate(samples):
        meta: dict[str, Any] = {}
        nulls = []
        for name, dtype in fields.items():
            if dtype is None:
                meta[name] = getattr(sample, name)
                continue
            if name in R3_FIELD.values():
                payload = sample.replay.get(name)
                if payload is None:
                    nulls.append(name)
                    continue
                array = _replay_tensor(name, payload, routing_replay_layers)
            else:
                array = np.asarray(getattr(sample, name), dtype=dtype)
            tensors[f"{name}.{i}"] = np.ascontiguousarray(array, dtype=dtype)
        meta["nulls"] = nulls
        metas.append(meta)
    head = {"samples": metas, "session_metadata": session_metadata, "empty_reason": empty_reason}
    if images is not None:
        head["images"] = {image.sha256: {"mime_type": image.mime_type, "width": image.width,
                                         "height": image.height} for image in images}
        for image in images:
            tensors[f"{IMAGE_TENSOR_PREFIX}{image.sha256}"] = np.frombuffer(image.data, dtype=np.uint8)
    tensors[META_KEY] = np.frombuffer(json.dumps(head, ensure_ascii=False, separators=(",", ":")).encode(),
                                      dtype=np.uint8)
    return safetensors.numpy.save(tensors)
