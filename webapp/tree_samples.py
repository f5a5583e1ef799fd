"""Training samples of a tree session (miles' v2 sessions): one raw sample per leaf, then a
picker and a post-processor, each a named, replaceable function.

``POST /sessions/{id}/samples`` on a tree session answers what miles main's
``SessionCoreV2.collect_samples`` answers (``miles/rollout/session/v2/core.py``, ``v2/utils.py``,
``v2/picker_hub/``, ``v2/postprocessor_hub/`` at 31f1ca96):

1. **Leaf material** (:func:`leaf_material`): for each leaf in commit order, the records of its
   root-to-leaf path assembled by the v1 rules (:func:`webapp.samples.assemble_samples` over the
   path's records and the leaf's token ids: per-turn samples, ``max_seq_len``, the merge) into one
   raw sample; a leaf whose turns all truncate away is left out. Each sample's metadata carries,
   besides the v1 keys, the flat keys ``accumulated_token_ids`` (the leaf's ids), ``leaf``
   (``node_id``, ``parent``, ``path_node_ids``, ``response_id``) and, when computable, the leaf's
   own ``tito_session_mismatch``.
2. **Pick** (``fn(leaf_samples, session_metadata) -> list[Sample]``): a pure selection, drop or
   reorder, never rewrite; default :func:`drop_retries`. A result that is not a subset of its
   input (a copy, a stranger) or repeats a sample is the picker's failure.
3. **Post-process** (same signature): finalizes loss masks, metadata and rewards of the picked
   samples; default :func:`default_postprocess`.
4. Empty reasons: no node at all is ``no_records``; no material, or nothing left after the hooks,
   is ``all_truncated``.

An assembly rule broken is :class:`SampleAssemblyError` (422, as in v1); a hook that raises or
breaks its contract is :class:`SampleHookFailed` (422, naming both hooks as configured), never
a 500: it is a policy bug of the session, not the server's. Hooks run in the session worker, on
its thread, synchronously: a slow hook holds up that worker's other requests.

Hooks are selected by a table name (:data:`PICKERS`, :data:`POSTPROCESSORS`: miles' names), by
miles' own import path of a default (``miles.rollout.session.v2.picker_hub.drop_retries``, so a
miles configuration carries over), or by an import path ``package.module:function`` (or
``package.module.function``, miles' form); :func:`resolve_hook` raises
:class:`SampleHookSelectorError` for anything else (the launcher turns it into a one-line
start-up failure).

The wire is v1's (:func:`webapp.samples.encode_samples`) with miles' v2 field table
(``SAMPLES_VALUE_SPEC_V2`` in ``miles/rollout/session/samples/codec.py``): ``reward`` joins the
JSON fields (:data:`WIRE_FIELDS_V2`; null when no post-processor assigned one, which miles'
decoder reads as "keep the driver's own reward").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from webapp.errors import WebappError
from webapp.named_functions import resolve_function
from webapp.samples import WIRE_FIELDS, Sample, assemble_samples, encode_samples
from webapp.session_errors import SampleHookFailed
from webapp.tito import MAX_TRIM_TOKENS, TitoState, session_mismatch
from webapp.tokenizers import ChatTokenizer
from webapp.tree import SessionTree, TreeNode

__all__ = [
    "DEFAULT_PICKER",
    "DEFAULT_POSTPROCESSOR",
    "PICKERS",
    "POSTPROCESSORS",
    "SERVER_OWNED_METADATA_KEYS",
    "WIRE_FIELDS_V2",
    "SampleHook",
    "SampleHookSelectorError",
    "SampleHooks",
    "collect_tree_samples",
    "default_postprocess",
    "drop_retries",
    "encode_tree_samples",
    "leaf_material",
    "leaves_of",
    "resolve_hook",
]

log = logging.getLogger(__name__)

# fn(leaf_samples, session_metadata) -> samples: miles' hook signature for both stages
SampleHook = Callable[[list[Sample], dict[str, Any]], list[Sample]]
# miles' samples wire of v2 sessions: v1's fields plus ``reward`` (a JSON field)
WIRE_FIELDS_V2: dict[str, np.dtype | None] = {**WIRE_FIELDS, "reward": None}
# Per-sample metadata the server sets and the agent's ``metadata`` cannot replace or fill in.
SERVER_OWNED_METADATA_KEYS = ("accumulated_token_ids", "tito_session_mismatch", "leaf")


class SampleHookSelectorError(WebappError, ValueError):
    """A picker or post-processor selector that names no synchronous function."""


# -- 1. leaf material ------------------------------------------------------------------------------

def _leaf_mismatch(state: TitoState, tokenizer: ChatTokenizer) -> list[dict[str, Any]] | None:
    try:
        return session_mismatch(state, tokenizer)
    except Exception:  # as miles: a failed check is logged and left out, never fails /samples
        log.exception("tito_session_mismatch of a leaf failed")
        return None


def leaves_of(tree: SessionTree, upto: int | None = None) -> list[TreeNode]:
    """The leaves of the forest's first ``upto`` nodes (None: all), in commit order: the tree as
    a snapshot saw it while commits go on (the forest is append-only, children have later seqs)."""
    if upto is None or upto >= len(tree.nodes):
        return tree.leaves()
    return [node for node in tree.nodes[:upto] if not any(child.seq < upto for child in node.children)]


def leaf_material(tree: SessionTree, tokenizer: ChatTokenizer, *, max_seq_len: int | None,
                  mismatch: Callable[[TreeNode], list[dict[str, Any]] | None] | None = None,
                  upto: int | None = None) -> list[Sample]:
    """One raw sample per leaf of the first ``upto`` nodes (:func:`leaves_of`), in commit order
    (module docstring, step 1).

    ``mismatch(leaf)``: the leaf's ``tito_session_mismatch`` (None: left out); default: computed
    here. Raises :class:`SampleAssemblyError` when a path's records break a v1 rule."""
    material: list[Sample] = []
    for leaf in leaves_of(tree, upto):
        path = leaf.path()
        samples, _empty = assemble_samples([node.turn for node in path], leaf.state.token_ids, tokenizer,
                                           max_seq_len=max_seq_len, max_trim_tokens=MAX_TRIM_TOKENS)
        if not samples:
            continue  # every turn truncated away
        (sample,) = samples
        flat: dict[str, Any] = {
            "accumulated_token_ids": list(leaf.state.token_ids),
            "leaf": {"node_id": leaf.seq, "parent": leaf.parent.seq if leaf.parent is not None else None,
                     "path_node_ids": [node.seq for node in path], "response_id": leaf.response_id},
        }
        found = mismatch(leaf) if mismatch is not None else _leaf_mismatch(leaf.state, tokenizer)
        if found is not None:
            flat["tito_session_mismatch"] = found
        sample.metadata = {**sample.metadata, **flat}
        material.append(sample)
    return material


# -- 2. pickers ----------------------------------------------------------------------------------

def drop_retries(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    """miles' default picker: a leaf with a sibling committed after it (same parent, later
    ``seq``) is an abandoned attempt the agent retried: dropped. Root leaves and leaves without
    a later sibling are kept, ordered by path length, then ``seq``, both descending.

    ``seq`` decides, never the wall clock or the length: a later sibling committed at an
    earlier ``committed_at``, or a dropped leaf longer than every leaf under its later
    siblings, is logged as a warning and dropped all the same (a custom picker can keep it)."""
    tree = session_metadata["tree"]
    nodes = {row["id"]: row for row in tree["nodes"]}
    children: dict[int, list[int]] = {}
    for row in tree["nodes"]:
        if row["parent"] is not None:
            children.setdefault(row["parent"], []).append(row["id"])
    deepest: dict[int, int] | None = None  # node -> most tokens of a leaf under it (warnings only)

    kept: list[Sample] = []
    for sample in leaf_samples:
        leaf = sample.metadata["leaf"]
        node_id, parent = leaf["node_id"], leaf["parent"]
        later = [] if parent is None else [s for s in children[parent] if s > node_id]
        if not later:
            kept.append(sample)
            continue
        committed_at = nodes[node_id]["committed_at"]
        regressions = [(s, nodes[s]["committed_at"]) for s in later if nodes[s]["committed_at"] < committed_at]
        if regressions:
            log.warning("drop_retries: wall-clock rollback for superseded leaf (response_id=%r, seq=%d, "
                        "committed_at=%s), later siblings %s; continuing by seq", leaf["response_id"], node_id,
                        committed_at, regressions)
        if deepest is None:
            # Children have later seqs than their parents: one pass from the last node up.
            deepest = {}
            for row in reversed(tree["nodes"]):
                kids = children.get(row["id"])
                deepest[row["id"]] = max(deepest[k] for k in kids) if kids else row["num_tokens"]
        survivors_max = max(deepest[s] for s in later)
        if nodes[node_id]["num_tokens"] > survivors_max:
            log.warning("drop_retries: dropping superseded leaf (response_id=%r, seq=%d) although it is longer "
                        "than every later sibling's deepest leaf (%d > %d tokens); continuing by seq; a custom "
                        "picker can keep it", leaf["response_id"], node_id, nodes[node_id]["num_tokens"],
                        survivors_max)
        log.info("drop_retries: dropped superseded retry leaf seq=%d", node_id)
    return sorted(kept, key=lambda s: (len(s.metadata["leaf"]["path_node_ids"]), s.metadata["leaf"]["node_id"]),
                  reverse=True)


# -- 3. post-processors ----------------------------------------------------------------------------

def default_postprocess(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    """miles' default post-processor, in place and in picker order:

    - a completion shared by several picked leaves trains once: in the earliest committed
      (lowest ``node_id``) picked leaf through it; the others get loss mask 0 over its
      ``completion_span`` (clamped to what truncation left of the response);
    - the agent's ``metadata`` (``session_metadata["agent"]``) joins each sample's metadata,
      except :data:`SERVER_OWNED_METADATA_KEYS` (the server's own values win; a key the server
      left out, such as a mismatch it could not compute, stays out);
    - the agent's ``reward``, when given and not null, becomes every sample's ``reward``."""
    nodes = {row["id"]: row for row in session_metadata["tree"]["nodes"]}
    agent = session_metadata.get("agent") or {}
    reward = agent.get("reward")
    agent_keys = {k: v for k, v in agent.items() if k not in SERVER_OWNED_METADATA_KEYS}

    owner: dict[int, int] = {}  # node -> the lowest picked leaf through it (picker order may differ)
    for sample in leaf_samples:
        leaf = sample.metadata["leaf"]
        for node_id in leaf["path_node_ids"]:
            owner[node_id] = min(leaf["node_id"], owner.get(node_id, leaf["node_id"]))

    for sample in leaf_samples:
        leaf = sample.metadata["leaf"]
        response_start = len(sample.tokens) - sample.response_length  # spans index tokens, the mask the response
        for node_id in leaf["path_node_ids"]:
            if owner[node_id] == leaf["node_id"]:
                continue
            start, end = nodes[node_id]["completion_span"]
            lo, hi = max(start - response_start, 0), min(end - response_start, sample.response_length)
            if hi > lo:
                sample.loss_mask[lo:hi] = [0] * (hi - lo)
        server = {k: sample.metadata[k] for k in SERVER_OWNED_METADATA_KEYS if k in sample.metadata}
        sample.metadata = {**sample.metadata, **agent_keys, **server}
        if reward is not None:
            sample.reward = reward
    return leaf_samples


# miles' names (the function names of its picker_hub / postprocessor_hub)
PICKERS: dict[str, SampleHook] = {"drop_retries": drop_retries}
POSTPROCESSORS: dict[str, SampleHook] = {"default_postprocess": default_postprocess}
DEFAULT_PICKER, DEFAULT_POSTPROCESSOR = "drop_retries", "default_postprocess"
# miles' import paths of its defaults, so a miles configuration's values select ours
_MILES_PATHS = {"miles.rollout.session.v2.picker_hub.drop_retries": drop_retries,
                "miles.rollout.session.v2.picker_hub.drop_retries.drop_retries": drop_retries,
                "miles.rollout.session.v2.postprocessor_hub.default_postprocess": default_postprocess,
                "miles.rollout.session.v2.postprocessor_hub.default_postprocess.default_postprocess":
                    default_postprocess}


def resolve_hook(selector: str, table: Mapping[str, SampleHook], what: str = "hook") -> SampleHook:
    """The function ``selector`` names (module docstring). Raises
    :class:`SampleHookSelectorError` naming ``what`` when it names none, or names an object that
    is not callable or is a coroutine function (hooks run synchronously)."""
    if not isinstance(selector, str) or not selector.strip():
        raise SampleHookSelectorError(f"{what}: empty selector (a name of {sorted(table)} or package.module:function)")
    selector = selector.strip()
    fn = resolve_function(selector, {**_MILES_PATHS, **table}, SampleHookSelectorError, what,
                          f"{what} {selector!r}: not one of {sorted(table)} and not an import path "
                          "package.module:function")
    hook: SampleHook = fn
    return hook


@dataclass(frozen=True)
class SampleHooks:
    """The picker and post-processor of a session core, with the selectors that named them
    (a hook's failure is reported by its selector, as configured)."""

    picker: SampleHook = drop_retries
    postprocessor: SampleHook = default_postprocess
    picker_name: str = DEFAULT_PICKER
    postprocessor_name: str = DEFAULT_POSTPROCESSOR

    @classmethod
    def resolve(cls, picker: str | None, postprocessor: str | None) -> SampleHooks:
        """Raises :class:`SampleHookSelectorError`; None: the default."""
        picker = picker or DEFAULT_PICKER
        postprocessor = postprocessor or DEFAULT_POSTPROCESSOR
        return cls(resolve_hook(picker, PICKERS, "session sample picker"),
                   resolve_hook(postprocessor, POSTPROCESSORS, "session sample postprocessor"),
                   picker, postprocessor)


# -- the op ----------------------------------------------------------------------------------------

def _failed(hooks: SampleHooks, why: str) -> SampleHookFailed:
    return SampleHookFailed(f"session sample hook failed (picker={hooks.picker_name}, "
                            f"postprocessor={hooks.postprocessor_name}): {why}",
                            picker=hooks.picker_name, postprocessor=hooks.postprocessor_name)


def collect_tree_samples(tree: SessionTree, tokenizer: ChatTokenizer, session_metadata: dict[str, Any], *,
                         max_seq_len: int | None, hooks: SampleHooks = SampleHooks(),
                         mismatch: Callable[[TreeNode], list[dict[str, Any]] | None] | None = None,
                         upto: int | None = None) -> tuple[list[Sample], str | None]:
    """The samples and, when there are none, why (module docstring). ``session_metadata`` is
    what the hooks see and the reply carries (the agent's ``metadata`` under ``agent``): a hook
    may change it, so pass one of this call's own. ``upto``: the nodes its ``tree`` tables hold
    (None: all). Raises :class:`SampleAssemblyError` or :class:`SampleHookFailed`."""
    if not (tree.nodes[:upto] if upto is not None else tree.nodes):
        return [], "no_records"
    material = leaf_material(tree, tokenizer, max_seq_len=max_seq_len, mismatch=mismatch, upto=upto)
    if not material:
        return [], "all_truncated"
    allowed = {id(sample) for sample in material}
    try:
        picked = hooks.picker(list(material), session_metadata)
        ids = [id(sample) for sample in picked]
        if any(i not in allowed for i in ids) or len(ids) != len(set(ids)):
            raise ValueError("pick hook must return a subset of its input samples without duplicates "
                             "(pure selection)")
        samples = hooks.postprocessor(list(picked), session_metadata)
        if not isinstance(samples, list) or not all(isinstance(s, Sample) for s in samples):
            raise TypeError(f"postprocess hook must return a list of samples, got {type(samples).__name__}")
    except Exception as exc:  # a policy bug: the session's 422 naming the hooks, never the worker's 500
        raise _failed(hooks, f"{type(exc).__name__}: {exc}") from exc
    if not samples:
        return [], "all_truncated"
    return samples, None


def encode_tree_samples(samples: Sequence[Sample], session_metadata: dict[str, Any], empty_reason: str | None,
                        *, routing_replay_layers: int, hooks: SampleHooks = SampleHooks(),
                        images: Sequence[Any] | None = None) -> bytes:
    """The v1 payload (:func:`webapp.samples.encode_samples`) with :data:`WIRE_FIELDS_V2`.

    What the hooks returned is all that varies here: a value the wire cannot carry (metadata
    or a reward JSON cannot hold, a loss mask outside uint8) is :class:`SampleHookFailed`."""
    try:
        return encode_samples(samples, session_metadata, empty_reason, routing_replay_layers=routing_replay_layers,
                              images=images, fields=WIRE_FIELDS_V2)
    except (TypeError, ValueError, OverflowError) as exc:
        raise _failed(hooks, f"their samples cannot be encoded: {type(exc).__name__}: {exc}") from exc
