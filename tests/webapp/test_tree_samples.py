"""Tree sessions' samples (``webapp.tree_samples``) in process, on trees built node by node.

The rules and the fixtures are miles' (``tests/fast/router/test_session_samples_op_v2.py`` at
31f1ca96: the two-turn golden trajectory, retry / deep-abandoned / two-root / ordering shapes,
the hook contract); the payloads are decoded by :func:`decode_v2`, written from miles' codec
(``samples/codec.py``: ``SAMPLES_VALUE_SPEC_V2``), not from ours.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from tests.webapp import sample_hooks
from webapp.samples import TurnRecord
from webapp.session_errors import SampleAssemblyError, SampleHookFailed
from webapp.tito import TitoState
from webapp.tokenizers import ByteChatTokenizer
from webapp.tree import SessionTree, TreeNode
from webapp.tree_samples import (
    PICKERS,
    POSTPROCESSORS,
    SampleHooks,
    SampleHookSelectorError,
    collect_tree_samples,
    default_postprocess,
    drop_retries,
    encode_tree_samples,
    leaf_material,
    resolve_hook,
)

TOK = ByteChatTokenizer()
HOOKS = "tests.webapp.sample_hooks"
DEFAULT_HOOKS = SampleHooks()
AGENT_METADATA = {"shared_key": "from-agent", "agent_only": 1, "accumulated_token_ids": "agent-plant"}


# -- a miles v2 consumer, from miles' codec ---------------------------------------------------------

def decode_v2(payload: bytes, *, v1: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any], str | None]:
    """``decode_samples_and_merge_input_sample(..., fields=COMPUTED_FIELDS_V2)`` without miles'
    Sample: the tensor fields with their pinned dtypes, the JSON fields, ``reward`` among them
    (``v1``: miles' ``COMPUTED_FIELDS``, a linear session's wire, which has no ``reward``)."""
    wire = {"tokens": np.int64, "loss_mask": np.uint8, "rollout_log_probs": np.float64,
            "rollout_routed_experts": np.int32, "rollout_indexer_topk": np.int32}
    json_fields: tuple[str, ...] = ("response", "response_length", "status", "weight_versions",
                                    "prefix_cache_info", "metadata")
    json_fields += () if v1 else ("reward",)
    tensors = safetensors.numpy.load(payload)
    meta = json.loads(tensors.pop("_samples_meta").tobytes().decode("utf-8"))
    samples = []
    for i, sample_meta in enumerate(meta["samples"]):
        nulls = set(sample_meta["nulls"])
        assert nulls <= set(wire), "null markers only name tensor fields"
        sample: dict[str, Any] = {name: sample_meta[name] for name in json_fields}  # KeyError: field missing
        assert not v1 or "reward" not in sample_meta, "the v1 wire carries no reward"
        for name, dtype in wire.items():
            if name in nulls:
                sample[name] = None
                continue
            arr = tensors.pop(f"{name}.{i}")
            assert arr.dtype == np.dtype(dtype), (name, arr.dtype)
            sample[name] = arr if name.startswith("rollout_") and name != "rollout_log_probs" else arr.tolist()
        samples.append(sample)
    assert not tensors, f"unreferenced tensors {sorted(tensors)}"
    return samples, meta["session_metadata"], meta["empty_reason"]


# -- trees -----------------------------------------------------------------------------------------

def fabricate(tree: SessionTree, parent: TreeNode | None, prompt: list[int], output: list[int], *,
              logprobs: list[float] | None = None, cached: int = 0, weight_version: str = "w1",
              committed_at: float | None = None, response_id: str = "", finish: str = "stop") -> TreeNode:
    """A node whose record sent ``prompt`` and got ``output``; its state's ids are their sum."""
    messages = (*(parent.state.messages if parent is not None else ()),
                {"role": "user", "content": f"u{len(tree)}"}, {"role": "assistant", "content": f"a{len(tree)}"})
    state = TitoState(messages=messages, tools_key=None, token_ids=(*prompt, *output), rendered_prompt="",
                      output_ended_with_eos=True)
    when = float(len(tree)) if committed_at is None else committed_at
    turn = TurnRecord(prompt_len=len(prompt), output_ids=tuple(output),
                      logprobs=tuple(logprobs if logprobs is not None else [-0.1] * len(output)),
                      finish_reason=finish, meta={"cached_tokens": cached, "prompt_tokens": len(prompt),
                                                  "weight_version": weight_version},
                      timestamp=when, request_timestamp=when, replay=())
    return tree.add(parent, state, turn, response_id=response_id, committed_at=when)


def two_turn(accumulated_tail: tuple[int, ...] = ()) -> SessionTree:
    """miles' ``_two_turn_records`` as a root and its child (``accumulated_tail``: ids the records
    never produced, appended to the leaf's)."""
    tree = SessionTree()
    root = fabricate(tree, None, [1, 2, 3], [10, 11], logprobs=[-0.125, -0.25], weight_version="w1")
    fabricate(tree, root, [1, 2, 3, 10, 11, 20, 21], [30, 31, *accumulated_tail], logprobs=[-0.5, -1.0],
              cached=5, weight_version="w2")
    if accumulated_tail:  # the extra ids are in the leaf's state only, not in its record
        leaf = tree.nodes[-1]
        leaf.turn = TurnRecord(**{**leaf.turn.__dict__, "output_ids": (30, 31), "logprobs": (-0.5, -1.0)})
    return tree


ACCUMULATED = [1, 2, 3, 10, 11, 20, 21, 30, 31]


def retry_shaped() -> tuple[SessionTree, TreeNode, TreeNode]:
    """root; an attempt at turn 2 (abandoned); the retry of turn 2 (later seq)."""
    tree = SessionTree()
    root = fabricate(tree, None, [1, 2, 3], [10, 11])
    abandoned = fabricate(tree, root, [1, 2, 3, 10, 11, 20], [30])
    retry = fabricate(tree, root, [1, 2, 3, 10, 11, 21], [31])
    return tree, abandoned, retry


def collect(tree: SessionTree, *, agent: dict[str, Any] | None = None, max_seq_len: int | None = None,
            hooks: SampleHooks = DEFAULT_HOOKS, mismatch: Any = None,
            ) -> tuple[list[dict[str, Any]], dict[str, Any], str | None]:
    metadata: dict[str, Any] = {"tree": tree.metadata()}
    if agent is not None:
        metadata["agent"] = agent
    samples, reason = collect_tree_samples(tree, TOK, metadata, max_seq_len=max_seq_len, hooks=hooks,
                                           mismatch=mismatch)
    return decode_v2(encode_tree_samples(samples, metadata, reason, routing_replay_layers=0, hooks=hooks))


def hooks(picker: str = "drop_retries", postprocessor: str = "default_postprocess") -> SampleHooks:
    return SampleHooks.resolve(picker, postprocessor)


# -- golden assembly on one path ---------------------------------------------------------------------

def test_two_turn_path_is_one_merged_sample_with_agent_metadata_under_server_keys():
    (m,), session_metadata, reason = collect(two_turn(), agent=AGENT_METADATA)
    assert reason is None
    assert m["tokens"] == ACCUMULATED
    assert m["response"] == TOK.decode([10, 11]) + TOK.decode([20, 21]) + TOK.decode([30, 31])
    assert m["response_length"] == 6
    assert m["loss_mask"] == [1, 1, 0, 0, 1, 1]
    assert m["rollout_log_probs"] == [-0.125, -0.25, 0.0, 0.0, -0.5, -1.0]
    assert m["status"] == "completed"
    assert m["weight_versions"] == ["w1", "w2"]
    assert m["prefix_cache_info"] == {"cached_tokens": 5, "total_prompt_tokens": 10}
    assert m["reward"] is None  # no reward given: null, the driver keeps its own
    # The agent's keys join; the server's flat keys win over an agent's plant of them.
    assert m["metadata"]["shared_key"] == "from-agent" and m["metadata"]["agent_only"] == 1
    assert m["metadata"]["accumulated_token_ids"] == ACCUMULATED
    assert m["metadata"]["leaf"] == {"node_id": 1, "parent": 0, "path_node_ids": [0, 1], "response_id": ""}
    assert session_metadata["agent"] == AGENT_METADATA


def test_max_seq_len_truncates_a_leaf_before_the_merge():
    (m,), _, _ = collect(two_turn(), max_seq_len=8)
    assert m["status"] == "truncated"
    assert m["tokens"] == ACCUMULATED[:8]
    assert m["loss_mask"] == [1, 1, 0, 0, 1]
    assert m["rollout_log_probs"] == [-0.125, -0.25, 0.0, 0.0, -0.5]


def test_empty_reasons():
    assert collect(SessionTree()) == ([], {"tree": {"nodes": [], "leaves": []}}, "no_records")
    samples, _, reason = collect(two_turn(), max_seq_len=2)
    assert samples == [] and reason == "all_truncated"
    samples, _, reason = collect(two_turn(), hooks=hooks(f"{HOOKS}:drop_everything"))
    assert samples == [] and reason == "all_truncated"


def test_broken_chain_is_an_assembly_error():
    with pytest.raises(SampleAssemblyError, match="cursor") as caught:
        collect(two_turn(accumulated_tail=(99,)))
    assert not isinstance(caught.value, SampleHookFailed) and caught.value.status == 422


def test_leaf_material_metadata_per_leaf():
    tree, abandoned, retry = retry_shaped()
    material = leaf_material(tree, TOK, max_seq_len=None, mismatch=lambda leaf: [{"leaf": leaf.seq}])
    assert [s.metadata["leaf"]["node_id"] for s in material] == [abandoned.seq, retry.seq]  # commit order
    for sample, leaf in zip(material, (abandoned, retry)):
        assert sample.tokens.tolist() == list(leaf.state.token_ids)
        assert sample.metadata["accumulated_token_ids"] == list(leaf.state.token_ids)
        assert sample.metadata["leaf"]["path_node_ids"] == [0, leaf.seq]
        assert sample.metadata["tito_session_mismatch"] == [{"leaf": leaf.seq}]
        assert sample.metadata["lifecycle"][-1]["turn"] == 2  # the v1 keys stay
    # A mismatch that cannot be computed is left out, never an error.
    material = leaf_material(tree, TOK, max_seq_len=None, mismatch=lambda leaf: None)
    assert all("tito_session_mismatch" not in s.metadata for s in material)


# -- the default picker ------------------------------------------------------------------------------

def test_superseded_retry_leaf_is_dropped():
    tree, _abandoned, retry = retry_shaped()
    (m,), _, _ = collect(tree)
    assert m["tokens"] == list(retry.state.token_ids)


@pytest.mark.parametrize("reward", [1.0, 0.0])
def test_deep_abandoned_branch_survives_and_shared_completion_trains_once(reward):
    tree = SessionTree()
    root = fabricate(tree, None, [1, 2, 3], [10, 11])
    mid = fabricate(tree, root, [1, 2, 3, 10, 11, 20], [30])
    early = fabricate(tree, mid, [1, 2, 3, 10, 11, 20, 30, 40], [50], response_id="early")
    late = fabricate(tree, root, [1, 2, 3, 10, 11, 21], [31], response_id="late")
    (early_sample, late_sample), _, _ = collect(tree, agent={"reward": reward})
    assert early_sample["tokens"] == list(early.state.token_ids)
    assert late_sample["tokens"] == list(late.state.token_ids)
    assert early_sample["loss_mask"][:2] == [1, 1]  # the earliest leaf owns the root's completion
    assert late_sample["loss_mask"][:2] == [0, 0]
    assert late_sample["loss_mask"][-1] == 1  # its own completion trains
    assert [early_sample["reward"], late_sample["reward"]] == [reward, reward]
    assert [early_sample["metadata"]["reward"], late_sample["metadata"]["reward"]] == [reward, reward]


def test_longer_superseded_leaf_warns_and_is_dropped_by_seq(caplog):
    tree = SessionTree()
    root = fabricate(tree, None, [1, 2, 3], [10, 11])
    fabricate(tree, root, [1, 2, 3, 10, 11, 20], [30, 31, 32])  # abandoned, longer than the retry
    retry = fabricate(tree, root, [1, 2, 3, 10, 11, 21], [31])
    with caplog.at_level(logging.WARNING, logger="webapp.tree_samples"):
        (m,), _, _ = collect(tree)
    assert m["tokens"] == list(retry.state.token_ids)
    assert "longer than every later sibling's deepest leaf" in caplog.text and "continuing by seq" in caplog.text


def test_wall_clock_rollback_warns_and_drops_by_seq(caplog):
    tree = SessionTree()
    root = fabricate(tree, None, [1, 2, 3], [10, 11])
    fabricate(tree, root, [1, 2, 3, 10, 11, 20], [30], committed_at=10.0)
    retry = fabricate(tree, root, [1, 2, 3, 10, 11, 21], [31], committed_at=5.0)
    with caplog.at_level(logging.WARNING, logger="webapp.tree_samples"):
        (m,), _, _ = collect(tree)
    assert m["tokens"] == list(retry.state.token_ids)
    assert "wall-clock rollback" in caplog.text and "continuing by seq" in caplog.text
    assert "longer than every later sibling" not in caplog.text


def test_two_roots_yield_two_samples_latest_first():
    tree = SessionTree()
    main = fabricate(tree, None, [1, 2, 3], [10, 11])
    sub = fabricate(tree, None, [7, 8], [70, 71])
    (first, second), metadata, _ = collect(tree)
    assert first["tokens"] == list(sub.state.token_ids) and second["tokens"] == list(main.state.token_ids)
    assert [n["parent"] for n in metadata["tree"]["nodes"]] == [None, None]
    assert [first["reward"], second["reward"]] == [None, None]
    assert first["loss_mask"] == [1, 1] and second["loss_mask"] == [1, 1]  # nothing shared


def test_order_is_path_length_then_latest_commit():
    tree = SessionTree()
    root = fabricate(tree, None, [1], [10])
    deep = fabricate(tree, root, [1, 10, 20], [30])
    shallow_early = fabricate(tree, None, [100, 101, 102, 103], [104, 105, 106, 107])
    shallow_late = fabricate(tree, None, [200, 201, 202, 203], [204, 205, 206])
    samples, _, _ = collect(tree)
    assert len(deep.state.token_ids) < len(shallow_late.state.token_ids) < len(shallow_early.state.token_ids)
    assert [s["metadata"]["leaf"]["node_id"] for s in samples] == [deep.seq, shallow_late.seq, shallow_early.seq]


def test_drop_retries_keeps_a_leaf_whose_later_sibling_is_another_subtree():
    """Only a sibling of the leaf itself supersedes it: a later sibling of an ancestor leaves
    a leaf deeper down alone (the deep-abandoned shape, one level lower)."""
    tree = SessionTree()
    root = fabricate(tree, None, [1], [10])
    a = fabricate(tree, root, [1, 10, 2], [11])
    a_leaf = fabricate(tree, a, [1, 10, 2, 11, 3], [12])
    fabricate(tree, a, [1, 10, 2, 11, 4], [13])  # later sibling of a_leaf: a_leaf is dropped
    b = fabricate(tree, root, [1, 10, 5], [14])
    samples, _, _ = collect(tree)
    kept = [s["metadata"]["leaf"]["node_id"] for s in samples]
    assert a_leaf.seq not in kept and kept == [3, b.seq]


# -- replaceable hooks and their contract --------------------------------------------------------

def test_keep_all_picker_by_import_path_moves_ownership_to_the_earliest_picked_leaf():
    tree, abandoned, retry = retry_shaped()
    (a, r), _, _ = collect(tree, hooks=hooks(f"{HOOKS}:keep_all"))
    assert a["tokens"] == list(abandoned.state.token_ids) and r["tokens"] == list(retry.state.token_ids)
    assert a["loss_mask"][:2] == [1, 1] and r["loss_mask"][:2] == [0, 0]
    (r, a), _, _ = collect(tree, hooks=hooks(f"{HOOKS}.reverse"))  # miles' dotted form; order is the picker's
    assert r["tokens"] == list(retry.state.token_ids)
    assert r["loss_mask"][:2] == [0, 0] and a["loss_mask"][:2] == [1, 1]


@pytest.mark.parametrize(("picker", "words"), [
    ("exploding", ["RuntimeError", "policy bug"]),
    ("impure", ["subset"]),
    ("duplicate", ["duplicates"]),
])
def test_a_picker_failure_is_a_hook_failure_naming_both_hooks(picker, words):
    tree, _, _ = retry_shaped()
    selector = f"{HOOKS}:{picker}"
    with pytest.raises(SampleHookFailed) as caught:
        collect(tree, hooks=hooks(selector))
    text = str(caught.value)
    assert f"picker={selector}" in text and "postprocessor=default_postprocess" in text
    assert all(word in text for word in words)
    assert caught.value.status == 422 and caught.value.picker == selector
    assert caught.value.code == "sample_hook_failed"


def test_a_postprocessor_returning_no_list_is_a_hook_failure():
    tree, _, _ = retry_shaped()
    with pytest.raises(SampleHookFailed, match=r"postprocessor=tests\.webapp\.sample_hooks:not_a_list"):
        collect(tree, hooks=hooks("drop_retries", f"{HOOKS}:not_a_list"))


def test_a_postprocessor_value_the_wire_cannot_carry_is_a_hook_failure():
    tree, _, _ = retry_shaped()

    def bad_reward(samples, metadata):
        for sample in samples:
            sample.reward = object()
        return samples

    broken = SampleHooks(postprocessor=bad_reward, postprocessor_name="bad_reward")
    with pytest.raises(SampleHookFailed, match="postprocessor=bad_reward.*cannot be encoded"):
        collect(tree, hooks=broken)


def test_agent_cannot_fill_missing_server_metadata():
    (m,), _, _ = collect(two_turn(), agent={"tito_session_mismatch": ["agent-plant"], "leaf": "x"},
                         mismatch=lambda leaf: None)
    assert "tito_session_mismatch" not in m["metadata"]
    assert m["metadata"]["leaf"]["node_id"] == 1


def test_default_postprocess_clamps_spans_to_a_truncated_response():
    tree = SessionTree()
    root = fabricate(tree, None, [1, 2], [10, 11, 12])
    fabricate(tree, root, [1, 2, 10, 11, 12, 3], [20, 21])
    fabricate(tree, root, [1, 2, 10, 11, 12, 4], [22, 23])
    # keep both leaves, cut to 4 tokens: the second leaf's response is [10, 11] only
    (first, second), _, _ = collect(tree, hooks=hooks(f"{HOOKS}:keep_all"), max_seq_len=4)
    assert first["loss_mask"] == [1, 1] and second["loss_mask"] == [0, 0]


def test_pickers_see_the_tree_tables_and_run_before_the_postprocessor():
    seen: list[str] = []

    def picker(samples, metadata):
        seen.append(f"pick {len(samples)} of {len(metadata['tree']['leaves'])}")
        return samples[:1]

    def post(samples, metadata):
        seen.append(f"post {len(samples)}")
        return default_postprocess(samples, metadata)

    tree, _, _ = retry_shaped()
    samples, _, _ = collect(tree, hooks=SampleHooks(picker, post, "p", "q"))
    assert seen == ["pick 2 of 2", "post 1"] and len(samples) == 1


# -- selectors ---------------------------------------------------------------------------------------

def test_selectors_resolve_table_names_miles_paths_and_import_paths():
    assert PICKERS == {"drop_retries": drop_retries}
    assert POSTPROCESSORS == {"default_postprocess": default_postprocess}
    assert resolve_hook("drop_retries", PICKERS) is drop_retries
    assert resolve_hook("miles.rollout.session.v2.picker_hub.drop_retries", PICKERS) is drop_retries
    assert resolve_hook("miles.rollout.session.v2.postprocessor_hub.default_postprocess",
                        POSTPROCESSORS) is default_postprocess
    assert resolve_hook(f"{HOOKS}:keep_all", PICKERS) is sample_hooks.keep_all
    assert resolve_hook(f"{HOOKS}.keep_all", PICKERS) is sample_hooks.keep_all
    assert resolve_hook("webapp.tree_samples:drop_retries", PICKERS) is drop_retries
    defaults = SampleHooks.resolve(None, "")  # unset (the settings' None, an empty value): the defaults
    assert (defaults.picker, defaults.postprocessor) == (drop_retries, default_postprocess)
    with pytest.raises(SampleHookSelectorError, match="session sample postprocessor 'nope'"):
        SampleHooks.resolve(None, "nope")


@pytest.mark.parametrize(("selector", "words"), [
    ("", "empty"),
    ("keep_everything", "not one of"),
    ("no_such_module_xyz:fn", "cannot import"),
    (f"{HOOKS}:missing", "has no"),
    (f"{HOOKS}:NOT_CALLABLE", "not callable"),
    (f"{HOOKS}:async_picker", "async"),
    ("webapp.tree_samples:", "not one of"),
])
def test_bad_selectors_are_a_typed_error(selector, words):
    with pytest.raises(SampleHookSelectorError, match=words) as caught:
        resolve_hook(selector, PICKERS, "session sample picker")
    assert isinstance(caught.value, ValueError) and "session sample picker" in str(caught.value)
