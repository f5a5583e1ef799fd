"""Screenshots reach the model: image parts, token-exact, through both server modes.

- The token count per image size follows Qwen2-VL's rule (a table computed by hand), in the
  byte tokenizer and in a model directory laid out as Qwen2-VL's (``vl_tokenizer_dir``).
- Text never forges a vision token; a client never forges a reference part.
- Through the real ``openai`` client in both modes: images reach the engine as ``image_data``
  in order, records hold ``sha256:`` references, ``?images=1`` returns each image once, the
  same image twice is stored once, earlier turns (images included) are never re-tokenized,
  bad images are 400 with the reason's code and the session stays usable, and the limits are
  settings in both modes.
- The reference backend's reply depends on the image bytes (one pixel).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import openai
import pytest
import requests
import safetensors.numpy
from blake3 import blake3
from PIL import Image

from webapp.images import ImageLimits, QwenVLRule, extract_images
from webapp.reference_backend import reference_completion
from webapp.session_errors import (
    ImageNotBase64,
    ImageTooLarge,
    ImageUndecodable,
    InvalidField,
    RemoteImageURL,
    TooManyImages,
)
from webapp.tito import INITIAL_STATE, plan_turn
from webapp.tokenizers import ByteChatTokenizer, HFChatTokenizer

from .test_miles_contract import GetSessionResponse

BYTE = ByteChatTokenizer()
MODES = {"single-process": 0, "router": 2}
LIMIT_FLAGS = ("--max-image-bytes", "60000", "--max-images", "5")

# (width, height) -> image tokens, worked out by hand from smart_resize (factor 28, min_pixels
# 3136, max_pixels 12845056): round each side to a multiple of 28, scale into the pixel bounds.
DEFAULT_RULE_TABLE = {
    (28, 28): 4,  # 784 px < min_pixels: scaled up to 56x56
    (100, 100): 16,  # 112x112
    (224, 224): 64,
    (1000, 20): 36,  # 1008x28
    (1024, 768): 999,  # 1036x756 -> 37 * 27
    (1280, 720): 1196,  # 1288x728 -> 46 * 26
    (1920, 1080): 2691,  # 1932x1092 -> 69 * 39
    (3000, 3000): 11449,  # 2996x2996 -> 107 * 107
}
# vl_tokenizer_dir's preprocessor_config.json: max_pixels 401408 (scaled down above it).
SMALL_MAX_RULE_TABLE = {(224, 224): 64, (1280, 720): 480, (1920, 1080): 480}


def png(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    img = Image.new("RGB", (width, height), ((seed * 37) % 256, (seed * 91) % 256, 128))
    img.putpixel((0, 0), (seed % 256, 0, 0))
    out = io.BytesIO()
    img.save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(data: bytes, mime: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def user(text: str, *images: bytes) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, *(image_part(i) for i in images)]}


def pad_runs(ids: list[int], start: int, pad: int) -> list[int]:
    """The length of each pad run opened by ``start``, in order."""
    runs: list[int] = []
    for prev, tid in zip([None, *ids], ids):
        if tid == pad:
            if prev == start:
                runs.append(0)
            runs[-1] += 1
    return runs


# --- the rule and the tokenizers ------------------------------------------------------------------

@pytest.mark.parametrize("size", sorted(DEFAULT_RULE_TABLE))
def test_default_rule_table(size):
    assert QwenVLRule().tokens(*size) == DEFAULT_RULE_TABLE[size]
    h, w = QwenVLRule().resized(*size)
    assert h % 28 == 0 and w % 28 == 0 and 3136 <= h * w <= 12845056


def test_byte_tokenizer_expands_each_image_by_the_rule():
    sizes = [(1280, 720), (100, 100), (28, 28)]
    messages = [user("look", *(png(w, h, k) for k, (w, h) in enumerate(sizes)))]
    extracted = extract_images(messages, ImageLimits(), {})
    plan = plan_turn(INITIAL_STATE, None, extracted.messages, None, BYTE)
    vision = BYTE.vision
    assert pad_runs(plan.prompt_ids, vision.start_id, vision.pad_id) == [DEFAULT_RULE_TABLE[s] for s in sizes]
    assert plan.prompt_ids.count(vision.end_id) == len(sizes)


def test_earlier_images_are_never_retokenized_and_never_replaced():
    from webapp.session_errors import AppendOnlyViolation
    from webapp.tito import commit_turn

    a, b = png(300, 200, 1), png(300, 200, 2)
    first = extract_images([user("one", a)], ImageLimits(), {})
    plan = plan_turn(INITIAL_STATE, None, first.messages, None, BYTE)
    reply = {"role": "assistant", "content": "ok"}
    state = commit_turn(plan, reply, BYTE.encode("ok") + [BYTE.eos_token_id], BYTE.eos_token_id)
    second = extract_images([user("one", a), reply, user("two", b)], ImageLimits(), first.new)
    assert [image.sha256 for image, _ in second.images] == [hashlib.sha256(x).hexdigest() for x in (a, b)]
    assert list(second.new) == [hashlib.sha256(b).hexdigest()]  # a: held already, not decoded again
    plan2 = plan_turn(state, None, second.messages, None, BYTE)
    assert plan2.prompt_ids[:len(state.token_ids)] == list(state.token_ids)
    runs = pad_runs(plan2.prompt_ids, BYTE.vision.start_id, BYTE.vision.pad_id)
    assert runs == [QwenVLRule().tokens(300, 200)] * 2
    swapped = extract_images([user("one", b), reply, user("two", b)], ImageLimits(), first.new)
    with pytest.raises(AppendOnlyViolation):  # an earlier screenshot replaced: not append-only
        plan_turn(state, None, swapped.messages, None, BYTE)


def test_a_committed_image_is_recognised_by_its_data_url_without_decoding_it(monkeypatch):
    import webapp.images as images_module

    a, b = png(300, 200, 1), png(300, 200, 2)
    first = extract_images([user("one", a)], ImageLimits(), {})
    held, learned = dict(first.new), dict(first.url_keys)
    assert list(learned.values()) == [hashlib.sha256(a).hexdigest()]
    decoded: list[str] = []
    real = images_module.pybase64.b64decode
    monkeypatch.setattr(images_module.pybase64, "b64decode", lambda s, **kw: decoded.append(s) or real(s, **kw))
    reply = {"role": "assistant", "content": "ok"}
    second = extract_images([user("one", a), reply, user("two", b)], ImageLimits(), held, learned)
    assert len(decoded) == 1 and base64.b64decode(decoded[0]) == b  # only the new screenshot decoded
    assert [image.sha256 for image, _ in second.images] == [hashlib.sha256(x).hexdigest() for x in (a, b)]
    assert second.messages[0]["content"][1] == first.messages[0]["content"][1]  # the same reference part
    # each part's URL text as sent, ready to splice into the engine request, and learned by it
    urls = [part["image_url"]["url"] for m in (user("one", a), user("two", b)) for part in m["content"]
            if part["type"] == "image_url"]
    assert [text for _, text in second.images] == [url.encode() for url in urls]
    assert set(second.url_keys) == {blake3(url.encode()).digest() for url in urls}
    # a digest the session learned but whose image it no longer holds: decoded again, not trusted
    decoded.clear()
    again = extract_images([user("one", a)], ImageLimits(), {}, learned)
    assert len(decoded) == 1 and list(again.new) == [hashlib.sha256(a).hexdigest()]


def test_hf_adapter_loads_a_qwen2_vl_directory(vl_tokenizer_dir):
    tok = HFChatTokenizer(vl_tokenizer_dir)
    assert tok.vision is not None and tok.vision.rule == QwenVLRule(max_pixels=401408)
    assert tok.vision.pad_id == tok._tok.token_to_id("<|image_pad|>")
    sizes = sorted(SMALL_MAX_RULE_TABLE)
    messages = [{"role": "system", "content": "You are an agent."},
                user("the screen", *(png(w, h, k) for k, (w, h) in enumerate(sizes)))]
    extracted = extract_images(messages, ImageLimits(), {})
    plan = plan_turn(INITIAL_STATE, None, extracted.messages, None, tok)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in plan.prompt_text
    assert pad_runs(plan.prompt_ids, tok.vision.start_id, tok.vision.pad_id) == [SMALL_MAX_RULE_TABLE[s]
                                                                                for s in sizes]


def test_the_template_may_come_in_chat_template_json(vl_tokenizer_dir, tmp_path):
    """Qwen2-VL / Qwen2.5-VL ship their template in the processor's chat_template.json."""
    import shutil

    for name in ("tokenizer.json", "preprocessor_config.json"):
        shutil.copy(f"{vl_tokenizer_dir}/{name}", tmp_path / name)
    config = json.loads(Path(vl_tokenizer_dir, "tokenizer_config.json").read_text())
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": config.pop("chat_template")}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFChatTokenizer(str(tmp_path))
    text = tok.render([user("hi", png(30, 30))], add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in text and tok.vision is not None


def test_a_text_only_model_refuses_images(hf_tokenizer_dir):
    tok = HFChatTokenizer(hf_tokenizer_dir)
    assert tok.vision is None
    extracted = extract_images([user("x", png(30, 30))], ImageLimits(), {})
    with pytest.raises(InvalidField, match="no vision tokens"):
        plan_turn(INITIAL_STATE, None, extracted.messages, None, tok)


@pytest.mark.parametrize("which", ["byte", "hf"])
def test_text_never_forges_a_vision_token(which, vl_tokenizer_dir):
    tok = BYTE if which == "byte" else HFChatTokenizer(vl_tokenizer_dir)
    forged = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"
    for content in (forged, [{"type": "text", "text": forged}]):
        plan = plan_turn(INITIAL_STATE, None, [{"role": "user", "content": content}], None, tok)
        vision = tok.vision
        assert not {vision.start_id, vision.pad_id, vision.end_id} & set(plan.prompt_ids)
        assert forged in tok.decode(plan.prompt_ids)


def test_a_client_cannot_send_a_reference_part():
    forged = {"role": "user", "content": [{"type": "image", "image": "sha256:" + "0" * 64, "width": 28,
                                           "height": 28}]}
    with pytest.raises(InvalidField, match="content\\[0\\].type"):
        extract_images([forged], ImageLimits(), {})


def test_bad_images_name_the_reason():
    limits = ImageLimits(max_image_bytes=10_000, max_images=2)
    cases = [
        ({"url": "https://example.com/a.png"}, RemoteImageURL),
        ({"url": "data:image/png;base64,@@@not base64@@@"}, ImageNotBase64),
        ({"url": data_url(b"plain text, not a picture")}, ImageUndecodable),
        ({"url": data_url(png(40, 40), "image/gif")}, ImageUndecodable),
        ({"url": data_url(png(10, 2500))}, ImageUndecodable),  # aspect ratio 250 > 200
    ]
    for spec, error in cases:
        with pytest.raises(error) as info:
            extract_images([{"role": "user", "content": [{"type": "image_url", "image_url": spec}]}], limits, {})
        assert "messages[0].content[0]" in str(info.value)
    with pytest.raises(ImageTooLarge, match="max_image_bytes=10000"):
        extract_images([user("x", _large_png())], limits, {})
    with pytest.raises(TooManyImages):
        extract_images([user("x", png(30, 30, 1), png(30, 30, 2), png(30, 30, 3))], limits, {})
    with pytest.raises(InvalidField, match="user and tool"):
        extract_images([{"role": "assistant", "content": [image_part(png(30, 30))]}], limits, {})


def test_a_truncated_image_is_undecodable():
    whole = png(64, 64, 5, "JPEG")
    with pytest.raises(ImageUndecodable):
        extract_images([user("x", whole[: len(whole) // 2])], ImageLimits(), {})


def test_a_jpeg_is_refused_exactly_when_its_full_size_decode_fails():
    """JPEGs are decoded at 1/8 size (libjpeg's DCT scaling): the same files must fail."""
    import random

    rng = random.Random(3)
    buf = io.BytesIO()
    Image.frombytes("RGB", (320, 200), rng.randbytes(320 * 200 * 3)).save(buf, "JPEG", quality=80)
    whole = buf.getvalue()
    outcomes = set()
    for _ in range(40):
        cut = rng.randrange(len(whole))
        data = bytearray(whole[:cut] if rng.random() < 0.5 else whole)
        for _ in range(rng.randint(0, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            with Image.open(io.BytesIO(bytes(data))) as img:
                img.load()
            full_ok = True
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):  # what webapp.images refuses
            full_ok = False
        try:
            extract_images([user("x", bytes(data))], ImageLimits(), {})
            ours_ok = True
        except ImageUndecodable:
            ours_ok = False
        assert ours_ok == full_ok, cut
        outcomes.add(ours_ok)
    assert outcomes == {True, False}  # both kinds were tried


def test_the_reference_backend_output_depends_on_one_pixel():
    a = png(64, 64, 3)
    img = Image.open(io.BytesIO(a))
    img.putpixel((63, 63), (1, 2, 3))
    out = io.BytesIO()
    img.save(out, "PNG")
    b = out.getvalue()
    ids = [1, 2, 3]
    same = reference_completion(ids, BYTE, images=[a])
    assert reference_completion(ids, BYTE, images=[a])["choices"] == same["choices"]
    assert reference_completion(ids, BYTE, images=[b])["id"] != same["id"]
    assert reference_completion(ids, BYTE)["id"] != same["id"]


# --- through both server modes ---------------------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(MODES))
def server_url(request, backend, session_server_factory) -> str:
    server = session_server_factory.launch(MODES[request.param], backend.url, *LIMIT_FLAGS)
    return server.url


def new_client(url: str) -> tuple[str, openai.OpenAI]:
    sid = requests.post(url + "/sessions", timeout=30).json()["session_id"]
    return sid, openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused", max_retries=0, timeout=60)


def test_screenshots_through_the_openai_client(server_url):
    sid, client = new_client(server_url)
    shots = [png(320, 200, k) for k in range(3)]
    messages: list = [{"role": "system", "content": "You control a desktop."}, user("step 0", shots[0])]
    prompts = []
    for k in range(1, 3):
        completion = client.chat.completions.create(model="any", messages=messages)
        messages += [completion.choices[0].message.model_dump(),
                     {"role": "tool", "tool_call_id": f"c{k}", "content": [image_part(shots[k])]},
                     user(f"step {k}", shots[0])]  # the first screenshot again: stored once
        prompts.append(completion)
    client.chat.completions.create(model="any", messages=messages)

    plain = requests.get(f"{server_url}/sessions/{sid}", timeout=30)
    assert "images" not in plain.json() and len(plain.content) < 100_000  # refs, not pixels
    got = requests.get(f"{server_url}/sessions/{sid}", params={"images": "1"}, timeout=30)
    session = GetSessionResponse.model_validate(got.json())  # still miles-valid
    images = got.json()["images"]
    want = {hashlib.sha256(s).hexdigest(): s for s in shots}
    assert set(images) == set(want)  # each image once, the repeated one too
    for digest, image in images.items():
        assert base64.b64decode(image["data"]) == want[digest]
        assert (image["mime_type"], image["width"], image["height"]) == ("image/png", 320, 200)

    vision = BYTE.vision
    order = [[0], [0, 1, 0], [0, 1, 0, 2, 0]]  # images in order of appearance, per turn
    previous: list[int] = []
    for record, expected in zip(session.records, order):
        sent = record.request
        assert sent["image_data"] == ["sha256:" + hashlib.sha256(shots[k]).hexdigest() for k in expected]
        assert pad_runs(sent["input_ids"], vision.start_id, vision.pad_id) == [QwenVLRule().tokens(320, 200)] * len(
            expected)
        assert sent["input_ids"][:len(previous)] == previous  # earlier turns, images included, as stored
        output = [t for _, t in record.response["choices"][0]["meta_info"]["output_token_logprobs"]]
        previous = sent["input_ids"] + output
        parts = [p for m in sent["messages"] if isinstance(m["content"], list) for p in m["content"]
                 if p["type"] == "image_url"]
        assert [p["image_url"]["url"] for p in parts] == sent["image_data"]
    assert session.metadata["accumulated_token_ids"] == previous
    assert session.metadata["tito_session_mismatch"] == []

    # /samples?images=1: the merged sample's tokens, its images in order, and their bytes
    got = requests.post(f"{server_url}/sessions/{sid}/samples", params={"images": "1"}, json={}, timeout=30)
    assert got.status_code == 200, got.text
    tensors = safetensors.numpy.load(got.content)
    head = json.loads(tensors["_samples_meta"].tobytes())
    sample = head["samples"][-1]
    assert sample["metadata"]["images"] == session.records[-1].request["image_data"]
    tokens = tensors[f"tokens.{len(head['samples']) - 1}"].tolist()
    assert len(pad_runs(tokens, vision.start_id, vision.pad_id)) == len(sample["metadata"]["images"])
    for digest, data in want.items():
        assert tensors[f"image.{digest}"].tobytes() == data and head["images"][digest]["width"] == 320
    plain = safetensors.numpy.load(requests.post(f"{server_url}/sessions/{sid}/samples", json={}, timeout=30).content)
    assert not any(name.startswith("image.") for name in plain)


def test_the_reply_depends_on_the_pixels_end_to_end(server_url):
    replies = []
    for seed in (7, 7, 8):
        _sid, client = new_client(server_url)
        replies.append(client.chat.completions.create(model="any", messages=[user("go", png(64, 48, seed))]).id)
    assert replies[0] == replies[1] != replies[2]


BAD_PARTS = {
    "remote_image_url": {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/shot.png"}},
    "image_not_base64": {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!!"}},
    "image_undecodable": {"type": "image_url", "image_url": {"url": data_url(b"\x89PNG but not really")}},
}


def _large_png() -> bytes:
    noisy = Image.frombytes("RGB", (200, 200), hashlib.shake_256(b"noise").digest(120_000))
    out = io.BytesIO()
    noisy.save(out, "PNG")
    assert len(out.getvalue()) > 60_000
    return out.getvalue()


@pytest.mark.parametrize("code", ["remote_image_url", "image_not_base64", "image_undecodable", "image_too_large",
                                  "too_many_images"])
def test_bad_images_are_400_and_the_session_stays_usable(server_url, code):
    sid, client = new_client(server_url)
    first = [user("start", png(50, 50, 1))]
    reply = client.chat.completions.create(model="any", messages=first)
    history = first + [reply.choices[0].message.model_dump()]
    if code == "image_too_large":
        bad = user("next", _large_png())
    elif code == "too_many_images":
        bad = user("next", *(png(30, 30, k) for k in range(2, 7)))  # 6 with the first: over 5
    else:
        bad = {"role": "user", "content": [BAD_PARTS[code]]}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="any", messages=history + [bad])
    assert info.value.status_code == 400
    assert info.value.body["code"] == code and "messages[2].content" in info.value.body["message"]
    good = client.chat.completions.create(model="any", messages=history + [user("next", png(50, 50, 9))])
    assert json.loads(good.choices[0].message.content)["action"]
    records = requests.get(f"{server_url}/sessions/{sid}", timeout=30).json()["records"]
    assert len(records) == 2 and not records[1]["rollback"]


def test_an_image_turn_lets_the_process_small_requests_run_before_its_image_work(monkeypatch):
    """In a gevent-patched process (a session worker) a request with images lets what the hub
    has pending (a small chat's greenlet) run before it decodes or hashes anything, once per
    request; a request without images does not wait."""
    import gevent
    from gevent import monkey

    import webapp.images as images_module

    monkeypatch.setattr(monkey, "is_module_patched", lambda name: name == "socket")
    order: list[str] = []
    real = images_module.pybase64.b64decode
    monkeypatch.setattr(images_module.pybase64, "b64decode",
                        lambda s, **kw: order.append("decode") or real(s, **kw))
    for messages, expected in (([user("one", png(30, 20, 1)), user("two", png(30, 20, 2))],
                                ["chat", "decode", "decode"]),
                               ([{"role": "user", "content": "text only"}], [])):
        order.clear()
        small = gevent.spawn(order.append, "chat")
        extract_images(messages, ImageLimits(), {})
        assert order == expected, order
        small.join()
