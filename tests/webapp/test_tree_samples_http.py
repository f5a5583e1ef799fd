"""``POST /sessions/{id}/samples`` of tree sessions over HTTP, in both server modes, against the
reference backend with R3 on; and the samples hooks' settings at start-up.

The oracles are not our tree code: each leaf's sample is checked against the linear server's
sample of the same conversation replayed on a v1 session (the path through a tree is a linear
conversation; miles' ``build_leaf_material`` assembles it by the v1 rules), its R3 against the
reference backend's pure function of the leaf's tokens, its loss mask against miles' ownership
rule (the earliest picked leaf through a shared completion trains it), and the picked set
against miles' ``drop_retries`` rule, stated per case.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from tests.webapp.test_tree_samples import decode_v2
from webapp.reference_backend import R3Shape, routed_experts_b64

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TREE_FLAGS = ("--session-mode", "v2")  # the server's sessions are trees (miles' --use-session-server v2)


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SHINKEN_")}
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "webapp.serve", "--bind", "127.0.0.1:0", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False, env=full)


@pytest.mark.parametrize(("args", "env", "words"), [
    (["--session-sample-picker-path", "keep_everything"], {}, ["session sample picker", "keep_everything"]),
    (["--session-sample-postprocessor-path", "tests.webapp.sample_hooks:missing"], {},
     ["session sample postprocessor", "has no 'missing'"]),
    (["--session-sample-picker-path", "tests.webapp.sample_hooks:async_picker"], {}, ["async"]),
    ([], {"SHINKEN_SESSION_SAMPLE_PICKER_PATH": "no_such_module_xyz:fn"}, ["cannot import"]),
    (["--session-sample-picker-path", "a b"], {}, ["--session-sample-picker-path", "must match"]),
])
def test_a_bad_hook_selector_is_one_line_and_exit_code_2(args, env, words):
    result = _serve(*args, env=env)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("usage:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(word in lines[0] for word in words), lines[0]
    assert result.stdout == ""  # nothing started


# -- samples per branching case, both modes -----------------------------------------------------------

R3 = R3Shape(layers=3, top_k=2)
REPLAY = ("--routing-replay-layers", str(R3.layers))
KEEP_ALL_OR_EXPLODE = "tests.webapp.sample_hooks:keep_all_or_explode"
SYSTEM = {"role": "system", "content": "You operate a desktop."}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


@dataclass
class Servers:
    v1: str
    v2: str
    hooked: str  # a tree server whose picker is KEEP_ALL_OR_EXPLODE, by import path


@pytest.fixture(scope="module", params=[0, 2], ids=["workers0", "router"])
def servers(request, reference_backend_factory, session_server_factory) -> Servers:
    backend = reference_backend_factory(r3_layers=R3.layers, r3_topk=R3.top_k)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def start(*flags: str) -> str:
        return session_server_factory.launch(request.param, backend.url, *REPLAY, *flags, env=env).url

    return Servers(start(), start(*TREE_FLAGS),
                   start(*TREE_FLAGS, "--session-sample-picker-path", KEEP_ALL_OR_EXPLODE))


class Conversation:
    """One session; ``send`` posts a request's messages and returns the assistant's reply."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sid = requests.post(f"{url}/sessions", timeout=30).json()["session_id"]

    def send(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        reply = requests.post(f"{self.url}/sessions/{self.sid}/v1/chat/completions",
                              json={"messages": messages}, timeout=60)
        assert reply.status_code == 200, reply.text
        message: dict[str, Any] = reply.json()["choices"][0]["message"]
        return message

    def samples(self, **body: Any) -> requests.Response:
        return requests.post(f"{self.url}/sessions/{self.sid}/samples", json=body, timeout=60)

    def decoded(self, **body: Any) -> tuple[list[dict[str, Any]], dict[str, Any], str | None]:
        reply = self.samples(**body)
        assert reply.status_code == 200, reply.text
        return decode_v2(reply.content)


def linear_oracle(url: str, requests_: list[list[dict[str, Any]]]) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """The linear server's sample of one path's requests replayed on a v1 session, and each
    turn's completion span in its tokens (from its records)."""
    conversation = Conversation(url)
    for messages in requests_:
        conversation.send(messages)
    (sample,), _, reason = decode_v2(conversation.samples().content, v1=True)
    assert reason is None
    records = requests.get(f"{url}/sessions/{conversation.sid}", timeout=30).json()["records"]
    spans = []
    for record in records:
        start = len(record["request"]["input_ids"])
        spans.append((start, start + len(record["response"]["choices"][0]["meta_info"]["output_token_logprobs"])))
    return sample, spans


def expected_r3(tokens: list[int]) -> np.ndarray:
    """The reference backend's routed experts for a sequence: a pure function of its ids."""
    raw = base64.b64decode(routed_experts_b64(tokens, len(tokens) - 1, R3))
    return np.frombuffer(raw, dtype="<i4").reshape(len(tokens) - 1, R3.layers, R3.top_k)


def check_leaf(sample: dict[str, Any], oracle: tuple[dict[str, Any], list[tuple[int, int]]],
               not_owned: int = 0) -> None:
    """``sample`` is the oracle's, except loss mask 0 over the completions of the path's first
    ``not_owned`` turns (an earlier picked leaf trains them)."""
    linear, spans = oracle
    assert sample["tokens"] == linear["tokens"]
    assert sample["response_length"] == linear["response_length"] and sample["status"] == linear["status"]
    assert sample["rollout_log_probs"] == linear["rollout_log_probs"]
    assert sample["weight_versions"] == linear["weight_versions"]
    mask = list(linear["loss_mask"])
    start = len(linear["tokens"]) - linear["response_length"]
    for lo, hi in spans[:not_owned]:
        mask[max(lo - start, 0):hi - start] = [0] * (hi - max(lo, start))
    assert sample["loss_mask"] == mask
    assert np.array_equal(sample["rollout_routed_experts"], linear["rollout_routed_experts"])
    assert np.array_equal(sample["rollout_routed_experts"], expected_r3(sample["tokens"]))
    assert sample["metadata"]["accumulated_token_ids"] == sample["tokens"]


def path_nodes(sample: dict[str, Any]) -> list[int]:
    return list(sample["metadata"]["leaf"]["path_node_ids"])


def test_pure_retry_keeps_the_retried_branch_only(servers):
    tree = Conversation(servers.v2)
    a = [SYSTEM, user("rename report.pdf")]
    b = [*a, tree.send(a), user("the file menu is open")]
    tree.send(b)  # the attempt
    c = [*b, tree.send(b), user("the dialog asks for a name")]  # the retry, then the conversation goes on
    tree.send(c)
    (sample,), metadata, reason = tree.decoded()
    assert reason is None and len(metadata["tree"]["nodes"]) == 4
    assert path_nodes(sample) == [0, 2, 3]  # seq 1 was superseded by its later sibling seq 2
    check_leaf(sample, linear_oracle(servers.v1, [a, b, c]))


def test_divergent_retry_keeps_the_new_branch(servers):
    tree = Conversation(servers.v2)
    a = [SYSTEM, user("rename report.pdf")]
    r1 = tree.send(a)
    tree.send([*a, r1, user("open the file menu")])
    b2 = [*a, r1, user("use the context menu instead")]
    c2 = [*b2, tree.send(b2), user("a menu appeared")]
    tree.send(c2)
    (sample,), _, _ = tree.decoded()
    assert path_nodes(sample) == [0, 2, 3]
    check_leaf(sample, linear_oracle(servers.v1, [a, b2, c2]))


def test_deep_divergence_two_samples_the_shared_turn_trains_once_and_rewards_both(servers):
    tree = Conversation(servers.v2)
    a = [SYSTEM, user("rename report.pdf")]
    r1 = tree.send(a)
    b = [*a, r1, user("open the file menu")]
    c = [*b, tree.send(b), user("the menu is open")]
    tree.send(c)
    b2 = [*a, r1, user("a subagent: check the disk first")]  # off the first turn, after a deep branch
    tree.send(b2)
    (deep, late), metadata, _ = tree.decoded(metadata={"reward": 0.5, "task": "t1"})
    assert path_nodes(deep) == [0, 1, 2] and path_nodes(late) == [0, 3]  # longer path first
    check_leaf(deep, linear_oracle(servers.v1, [a, b, c]))
    check_leaf(late, linear_oracle(servers.v1, [a, b2]), not_owned=1)  # seq 2's leaf owns the first turn
    assert [deep["reward"], late["reward"]] == [0.5, 0.5]
    assert deep["metadata"]["task"] == late["metadata"]["task"] == "t1"
    assert metadata["agent"] == {"reward": 0.5, "task": "t1"}


def test_a_new_root_is_a_sample_of_its_own(servers):
    tree = Conversation(servers.v2)
    a = [SYSTEM, user("rename report.pdf")]
    b = [*a, tree.send(a), user("open the file menu")]
    tree.send(b)
    x = [SYSTEM, user("an unrelated subtask: list the files")]
    tree.send(x)
    (first, second), metadata, _ = tree.decoded()
    assert [n["parent"] for n in metadata["tree"]["nodes"]] == [None, 0, None]
    assert path_nodes(first) == [0, 1] and path_nodes(second) == [2]
    check_leaf(first, linear_oracle(servers.v1, [a, b]))
    check_leaf(second, linear_oracle(servers.v1, [x]))
    assert first["reward"] is None and second["reward"] is None


def test_few_shot_examples_are_prompt_and_another_example_set_is_another_root(servers):
    tree = Conversation(servers.v2)
    shots = [SYSTEM, user("example: close the window"), {"role": "assistant", "content": '{"verb": "key"}'},
             user("example: scroll down"), {"role": "assistant", "content": '{"verb": "scroll"}'}]
    a = [*shots, user("rename report.pdf")]
    b = [*a, tree.send(a), user("the file menu is open")]
    tree.send(b)
    other = [*shots[:2], {"role": "assistant", "content": '{"verb": "click"}'}, *shots[3:], user("rename report.pdf")]
    tree.send(other)
    (first, second), metadata, _ = tree.decoded()
    assert [n["parent"] for n in metadata["tree"]["nodes"]] == [None, 0, None]
    first_oracle = linear_oracle(servers.v1, [a, b])
    check_leaf(first, first_oracle)
    check_leaf(second, linear_oracle(servers.v1, [other]))
    # The examples' assistant text is prompt: the response starts at the first generated token.
    assert len(first["tokens"]) - first["response_length"] == first_oracle[1][0][0]


def test_compaction_starts_a_root_and_the_old_history_stays_a_sample(servers):
    tree = Conversation(servers.v2)
    a = [SYSTEM, user("rename report.pdf")]
    b = [*a, tree.send(a), user("the file menu is open")]
    c = [*b, tree.send(b), user("the dialog asks for a name")]
    tree.send(c)
    compacted = [SYSTEM, user("summary so far: the rename dialog is open; type q3.pdf")]
    d = [*compacted, tree.send(compacted), user("typed")]
    tree.send(d)
    (old, new), _, _ = tree.decoded()
    assert path_nodes(old) == [0, 1, 2] and path_nodes(new) == [3, 4]
    check_leaf(old, linear_oracle(servers.v1, [a, b, c]))
    check_leaf(new, linear_oracle(servers.v1, [compacted, d]))


def test_max_seq_len_and_empty_reasons(servers):
    tree = Conversation(servers.v2)
    assert tree.decoded()[2] == "no_records"
    a = [SYSTEM, user("rename report.pdf")]
    tree.send(a)
    assert tree.decoded(max_seq_len=2)[:1] == ([],) and tree.decoded(max_seq_len=2)[2] == "all_truncated"
    (full,), _, _ = tree.decoded()
    (cut,), _, _ = tree.decoded(max_seq_len=len(full["tokens"]) - 1)
    assert cut["status"] == "truncated" and cut["tokens"] == full["tokens"][:-1]


def test_a_picker_by_import_path_and_its_failure_is_422_naming_it(servers):
    tree = Conversation(servers.hooked)
    a = [SYSTEM, user("rename report.pdf")]
    b = [*a, tree.send(a), user("the file menu is open")]
    tree.send(b)
    tree.send(b)  # a retry: drop_retries would keep one leaf, keep_all keeps both
    failed = tree.samples(metadata={"explode": True})
    assert failed.status_code == 422
    error = failed.json()["error"]
    assert f"picker={KEEP_ALL_OR_EXPLODE}" in error and "postprocessor=default_postprocess" in error
    assert "picker asked to explode" in error
    (attempt, retry), _, _ = tree.decoded()  # the session is untouched
    assert path_nodes(attempt) == [0, 1] and path_nodes(retry) == [0, 2]
    oracle = linear_oracle(servers.v1, [a, b])
    check_leaf(attempt, oracle)
    check_leaf(retry, oracle, not_owned=1)  # the attempt is the earliest picked leaf: it owns the first turn
    assert requests.get(f"{servers.hooked}/health", timeout=30).status_code == 200


def test_a_bad_metadata_field_is_400_on_both_kinds_of_session(servers):
    for url in (servers.v1, servers.v2):
        conversation = Conversation(url)
        reply = conversation.samples(metadata=5)
        assert reply.status_code == 400 and "metadata" in reply.json()["error"], reply.text


# -- v1 / v2 parity on a linear conversation -------------------------------------------------------

VARYING = ("timestamp", "request_timestamp")  # wall clocks of each run


def _comparable_record(record: dict[str, Any]) -> dict[str, Any]:
    record = {k: v for k, v in record.items() if k not in VARYING and k != "rollback"}  # a tree never rolls back
    response = dict(record["response"])
    response.pop("created")  # the engine's clock
    return {**record, "response": response}


def test_a_linear_conversation_is_the_same_on_both_kinds_of_session(servers):
    line, tree = Conversation(servers.v1), Conversation(servers.v2)
    messages: list[dict[str, Any]] = [SYSTEM, user("rename report.pdf")]
    for i in range(5):
        replies = line.send(messages), tree.send(messages)
        assert replies[0] == replies[1]
        messages = [*messages, replies[0], user(f"observation {i}")]
    got = {name: requests.get(f"{c.url}/sessions/{c.sid}", timeout=30).json() for name, c in
           (("v1", line), ("v2", tree))}
    assert "rollback" not in got["v2"]["records"][0] and got["v1"]["records"][0]["rollback"] is False
    assert [_comparable_record(r) for r in got["v1"]["records"]] == [_comparable_record(r) for r in
                                                                      got["v2"]["records"]]
    (v1,), v1_meta, _ = decode_v2(line.samples(max_seq_len=None).content, v1=True)
    (v2,), v2_meta, _ = tree.decoded(max_seq_len=None)
    for name in ("tokens", "response", "response_length", "loss_mask", "rollout_log_probs", "status",
                 "weight_versions", "prefix_cache_info"):
        assert v1[name] == v2[name], name
    assert np.array_equal(v1["rollout_routed_experts"], v2["rollout_routed_experts"])
    assert v2["reward"] is None and v1["rollout_indexer_topk"] is v2["rollout_indexer_topk"] is None
    # v2's sample metadata is v1's plus the flat keys of its leaf; lifecycle turn by turn
    flat = {"accumulated_token_ids", "leaf", "tito_session_mismatch"}
    assert set(v2["metadata"]) == set(v1["metadata"]) | flat
    assert [t["turn"] for t in v2["metadata"]["lifecycle"]] == [t["turn"] for t in v1["metadata"]["lifecycle"]]
    assert v2["metadata"]["tito_session_mismatch"] == v1_meta["tito_session_mismatch"]
    for key in ("accumulated_token_ids", "tito_session_mismatch", "max_trim_tokens", "num_records"):
        assert v1_meta[key] == v2_meta[key], key
    assert v2_meta == got["v2"]["metadata"]  # the samples reply and the GET expose the same metadata
