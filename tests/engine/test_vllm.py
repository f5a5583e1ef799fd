"""The session server in front of a real vLLM (CPU build), both server modes, two tiny models
(a dense Qwen2 and a Qwen3-MoE without routed experts: vLLM cannot return them on CPU).

- Token-exact: every record's prompt ids, output ids, logprobs and finish reason are what the
  engine itself answers when the same token-id request (same prompt ids, seed and sampling
  fields) is sent straight to its completions API -- finished by length, by the model's EOS
  and by a stop token id.
- TITO over 20 turns with tools and tool calls in Qwen2.5's real template: each turn's text as
  our HF adapter renders it equals ``transformers.AutoTokenizer.apply_chat_template``'s, the
  first prompt is transformers' ids, and each later prompt is the previous prompt + output
  followed by exactly transformers' ids of the new messages' text.
- miles' consumer (tests/webapp/test_miles_contract.py's, written from miles' code) reads the
  vLLM-served records and ``/samples`` unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.engine.engine import ENGINE_TEST_TIMEOUT, Engine, EngineFailed
from tests.engine.models import build_qwen2, build_qwen3_moe
from tests.engine.turns import (
    HISTORY,
    TOOLS,
    assert_record_is_the_engines,
    chat,
    direct,
    new_session,
    output_ids,
    records,
    template_ids,
)
from tests.webapp.test_miles_contract import (
    GetSessionResponse,
    assert_same_samples,
    consumer_samples,
    decode_payload,
)
from webapp.serve import start_session_server
from webapp.tokenizers import HFChatTokenizer

# A test's timeout covers its fixtures' setup: the first test of a module waits for an engine start.
pytestmark = [pytest.mark.engine, pytest.mark.integration, pytest.mark.timeout(ENGINE_TEST_TIMEOUT)]

MODELS = {"qwen2": build_qwen2, "qwen3_moe": build_qwen3_moe}

@pytest.fixture(scope="module", params=list(MODELS))
def engine(request, models_dir: Path, tmp_path_factory) -> Iterator[Engine]:
    """One engine per model, stopped before the next model's starts."""
    engine = Engine(MODELS[request.param](models_dir / request.param), (),
                    tmp_path_factory.mktemp("engine") / "vllm.log")
    try:
        engine.start()
    except EngineFailed as exc:
        pytest.fail(str(exc))
    yield engine
    engine.stop()


@pytest.fixture(scope="module", params=[0, 2], ids=["workers0", "router"])
def server(request, engine: Engine, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with start_session_server(request.param, engine.url, "127.0.0.1:0", "--tokenizer", str(engine.model_dir),
                              "--backend-kind", "vllm", log_path=log) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def hf(engine: Engine):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(engine.model_dir))


def eos_seed(engine: Engine, prompt: list[int], max_tokens: int) -> int:
    """A seed whose sampled run ends on an EOS id (random weights: ~1 in 500 per token)."""
    for seed in range(1000):
        own = direct(engine, prompt, seed=seed, max_tokens=max_tokens)
        if own["finish_reason"] == "stop":
            return seed
    raise AssertionError("no seed in 0..999 ends by EOS")


def test_token_exact_by_length_eos_and_stop_token(engine, server, hf):
    """Three sessions, one per way a turn ends, each continued for two more turns; every record
    equals the engine's own answer. The first prompt is transformers' rendering's ids."""
    first = template_ids(hf, HISTORY, TOOLS)
    eos = eos_seed(engine, first, 48)
    dry = direct(engine, first, seed=5, max_tokens=12)["token_ids"]
    stop_id = next(t for i, t in enumerate(dry) if i >= 2 and t not in dry[:i])
    cases = {"length": {"seed": 11, "max_tokens": 12},
             "eos": {"seed": eos, "max_tokens": 48},
             "stop_token": {"seed": 5, "max_tokens": 12, "stop_token_ids": [stop_id]}}
    for name, sampling in cases.items():
        sid = new_session(server)
        msgs = list(HISTORY)
        turns = [sampling, {"seed": 21, "max_tokens": 8, "temperature": 0.7}, {"seed": 22, "max_tokens": 8}]
        for k, fields in enumerate(turns):
            reply = chat(server, sid, msgs, tools=TOOLS, **fields)
            msgs += [reply["choices"][0]["message"], {"role": "tool", "tool_call_id": "c0", "content": f"step {k}"}]
        recs = records(server, sid)["records"]
        assert len(recs) == 3
        assert recs[0]["request"]["input_ids"] == first
        owns = [assert_record_is_the_engines(engine, rec, fields) for rec, fields in zip(recs, turns)]
        ends = {"length": ("length", None), "eos": ("stop", owns[0]["stop_reason"]),
                "stop_token": ("stop", stop_id)}[name]
        assert (owns[0]["finish_reason"], owns[0]["stop_reason"]) == ends, name
        if name == "eos":  # ended on one of generation_config's EOS ids (vLLM: a stop token, or the EOS itself)
            assert owns[0]["token_ids"][-1] in {hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
        if name == "stop_token":
            assert owns[0]["token_ids"][-1] == stop_id


def test_tito_stays_append_only_over_20_turns_with_transformers_rendering(engine, server, hf):
    """20 turns: tool results and user messages after each model reply, tools on every turn.
    Our adapter renders exactly what transformers renders; the first prompt is transformers'
    ids; each later prompt is the previous prompt + output + transformers' ids of the text the
    template adds (its closer after the output, then the new messages)."""
    ours = HFChatTokenizer(str(engine.model_dir))
    end_of_turn = hf.convert_tokens_to_ids("<|im_end|>")
    sid = new_session(server)
    msgs = list(HISTORY)
    previous: tuple[list[int], list[int], str] | None = None  # prompt, output, the text through the reply's turn
    for turn in range(20):
        text = hf.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert ours.render(msgs, add_generation_prompt=True, tools=TOOLS) == text
        reply = chat(server, sid, msgs, tools=TOOLS, seed=100 + turn, max_tokens=6)
        rec = records(server, sid)["records"][-1]
        prompt = rec["request"]["input_ids"]
        output = output_ids(rec)
        if previous is None:
            assert prompt == template_ids(hf, msgs, TOOLS)
        else:
            last_prompt, last_output, through_reply = previous
            head = last_prompt + last_output
            assert prompt[:len(head)] == head  # append-only: nothing earlier re-tokenized
            assert text.startswith(through_reply)
            # After the output: what the template writes after the reply's text (its end-of-turn
            # token, unless the model emitted it, and a newline), then the new messages.
            closer = "\n" if last_output and last_output[-1] == end_of_turn else "<|im_end|>\n"
            added = hf(closer + text[len(through_reply):], add_special_tokens=False)["input_ids"]
            assert prompt[len(head):] == added
        msgs.append(reply["choices"][0]["message"])
        previous = (prompt, output, hf.apply_chat_template(msgs, tools=TOOLS, tokenize=False))
        msgs.append({"role": "tool", "tool_call_id": "c0", "content": f"screen after step {turn}"} if turn % 2
                    else {"role": "user", "content": f"next, step {turn}"})
    session = records(server, sid)
    assert len(session["records"]) == 20
    last = session["records"][-1]
    assert session["metadata"]["accumulated_token_ids"] == last["request"]["input_ids"] + output_ids(last)


def test_miles_consumer_reads_the_vllm_records_and_samples(engine, server, hf):
    """Four turns with a rolled-back step: the records validate as miles' models, and
    ``/samples`` decodes to exactly what miles' consumer rebuilds from them. The first turns
    end by a stop token (every id is one: the engine's "stop"), so miles merges them into one
    sample covering the session; the last is cut by length."""
    tok = HFChatTokenizer(str(engine.model_dir))
    stop = {"stop_token_ids": list(range(len(hf)))}
    sid = new_session(server)
    msgs = list(HISTORY)
    a1 = chat(server, sid, msgs, tools=TOOLS, seed=1, **stop)["choices"][0]["message"]
    msgs += [a1, {"role": "tool", "tool_call_id": "c0", "content": "clicked"}]
    chat(server, sid, msgs, tools=TOOLS, seed=2, **stop)
    msgs[-1] = {"role": "tool", "tool_call_id": "c0", "content": "clicked twice"}  # the agent retries the step
    a2 = chat(server, sid, msgs, tools=TOOLS, seed=3, **stop)["choices"][0]["message"]
    msgs += [a2, {"role": "user", "content": "and now?"}]
    last = chat(server, sid, msgs, seed=4, max_tokens=5)  # tools absent this time
    assert last["choices"][0]["finish_reason"] == "length"
    body = records(server, sid)
    session = GetSessionResponse.model_validate(body)
    assert len(session.records) == 3 and body["metadata"]["num_rollbacks"] == 1
    assert [r["response"]["choices"][0]["finish_reason"] for r in body["records"]][:2] == ["stop", "stop"]
    for rec in body["records"]:
        assert rec["request"]["engine"]["kind"] == "vllm"
    resp = requests.post(f"{server}/sessions/{sid}/samples", json={"max_seq_len": None}, timeout=60)
    assert resp.status_code == 200, resp.text
    ours, session_metadata, empty_reason = decode_payload(resp.content)
    assert empty_reason is None
    assert session_metadata["accumulated_token_ids"] == body["metadata"]["accumulated_token_ids"]
    assert_same_samples(ours, consumer_samples(body, layers=0, max_seq_len=None, tok=tok))
    (sample,) = ours
    assert sample["tokens"] == body["metadata"]["accumulated_token_ids"]
    assert sample["status"] == "truncated" and len(sample["metadata"]["lifecycle"]) == 3
    assert set(sample["loss_mask"]) == {0, 1}
    assert sample["rollout_routed_experts"] is None  # R3 off: vLLM's CPU build cannot return it


def test_the_catch_all_proxy_reaches_the_engine(engine, server):
    sid = new_session(server)
    models = requests.get(f"{server}/sessions/{sid}/v1/models", timeout=30)
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == [engine.model]
