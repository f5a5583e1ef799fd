"""Image-pad counts against a real vision processor: ``transformers``' Qwen2-VL image processor.

What was possible here: vLLM's CPU build cannot serve a Qwen2-VL model on this machine (its
Qwen2-VL module imports transformers' torchvision image processor, and no torchvision matching
``torch 2.13.0+cpu`` installs: docs/session-server.md, "Tested against a real engine"). vLLM
counts image tokens with the model's Hugging Face processor, so the count is checked against
that processor's image half, ``Qwen2VLImageProcessorPil``, built from a local
``preprocessor_config.json`` (the tiny Qwen2-VL directory of :mod:`tests.engine.models`), and
the processor's rule for the text: each ``<|image_pad|>`` becomes ``grid_thw.prod() //
merge_size**2`` pads (transformers/models/qwen2_vl/processing_qwen2_vl.py).

- :class:`webapp.images.QwenVLRule` from the same config gives that count for screenshot sizes.
- End to end: the session server with that model directory as ``--tokenizer`` records, for
  each screenshot, exactly that many pad ids between the vision start and end ids.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import requests
from PIL import Image

from tests.engine.models import VL_PREPROCESSOR, build_qwen2_vl
from webapp.images import QwenVLRule
from webapp.serve import start_session_server
from webapp.tokenizers import HFChatTokenizer

pytestmark = [pytest.mark.engine, pytest.mark.integration]

# Screenshot sizes agents send (and one small and one 4K, which the max_pixels bound scales down).
SIZES = [(1920, 1080), (1280, 800), (1366, 768), (1024, 768), (3840, 2160), (300, 200)]


@pytest.fixture(scope="module")
def vl_dir(models_dir: Path) -> Path:
    return build_qwen2_vl(models_dir / "qwen2_vl")


@pytest.fixture(scope="module")
def processor(vl_dir: Path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = json.loads((vl_dir / "preprocessor_config.json").read_text())
    return Qwen2VLImageProcessorPil(**{k: v for k, v in config.items()
                                       if k not in ("image_processor_type", "processor_class")})


def screenshot(width: int, height: int) -> Image.Image:
    img = Image.new("RGB", (width, height), (240, 240, 240))
    for x in range(0, width, 97):  # some structure, so the encoder has something to resize
        img.paste((20, 90, 200), (x, 0, min(x + 11, width), height))
    return img


def processor_pads(processor, img: Image.Image) -> int:
    grid = processor(images=[img], return_tensors="np")["image_grid_thw"][0]
    return int(grid.prod()) // processor.merge_size ** 2


def test_the_processor_was_built_from_the_local_config(processor):
    # transformers 5 keeps min/max_pixels as the size's shortest/longest edge (in pixels).
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (VL_PREPROCESSOR["min_pixels"],
                                                                           VL_PREPROCESSOR["max_pixels"])
    assert processor.merge_size == 2 and processor.patch_size == 14


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_our_rule_counts_what_the_processor_counts(processor, size):
    rule = QwenVLRule.from_preprocessor_config(VL_PREPROCESSOR)
    assert rule.tokens(*size) == processor_pads(processor, screenshot(*size))


def _data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _pad_runs(ids: list[int], start: int, pad: int, end: int) -> list[int]:
    """The number of pad ids between each vision start id and its end id."""
    starts = [i for i, t in enumerate(ids) if t == start]
    runs = []
    for at in starts:
        close = ids.index(end, at)
        assert set(ids[at + 1:close]) == {pad}
        runs.append(close - at - 1)
    return runs


@pytest.mark.parametrize("workers", [0, 2], ids=["workers0", "router"])
def test_the_server_records_the_processors_pad_count(vl_dir, processor, workers, tmp_path):
    """Screenshots of three sizes in one session (two turns): each image's run of pad ids in the
    recorded prompt is the processor's count, in order, earlier images untouched."""
    tok = HFChatTokenizer(str(vl_dir))
    vision = tok.vision
    assert vision is not None
    shots = [screenshot(*s) for s in SIZES[:3]]
    expected = [processor_pads(processor, s) for s in shots]
    with start_session_server(workers, None, "127.0.0.1:0", "--tokenizer", str(vl_dir),
                              log_path=tmp_path / "server.log") as server:
        base = server.url
        sid = requests.post(f"{base}/sessions", timeout=30).json()["session_id"]
        msgs = [{"role": "user", "content": [
            {"type": "text", "text": "the screen"},
            {"type": "image_url", "image_url": {"url": _data_url(shots[0])}},
            {"type": "image_url", "image_url": {"url": _data_url(shots[1])}}]}]
        r1 = requests.post(f"{base}/sessions/{sid}/v1/chat/completions", timeout=60,
                           json={"model": "m", "messages": msgs, "max_tokens": 4})
        assert r1.status_code == 200, r1.text
        msgs += [r1.json()["choices"][0]["message"], {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(shots[2])}}]}]
        r2 = requests.post(f"{base}/sessions/{sid}/v1/chat/completions", timeout=60,
                           json={"model": "m", "messages": msgs, "max_tokens": 4})
        assert r2.status_code == 200, r2.text
        records = requests.get(f"{base}/sessions/{sid}", timeout=30).json()["records"]
    first, second = (r["request"]["input_ids"] for r in records)
    ids = (vision.start_id, vision.pad_id, vision.end_id)
    assert _pad_runs(first, *ids) == expected[:2]
    assert _pad_runs(second, *ids) == expected
    assert second[:len(first)] == first
