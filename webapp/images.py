"""Images in chat turns: OpenAI image parts checked, decoded once, hashed, and counted in tokens.

A client sends an image as an OpenAI content part of a ``user`` or ``tool`` message::

    {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,..."}}   (or image/png)

:func:`extract_images` turns each such part into a *reference part*, the form the session
state, the TITO comparison and the chat template see::

    {"type": "image", "image": "sha256:<hex>", "width": W, "height": H}

(``type: image`` is what Qwen2-VL-style templates render as ``<|vision_start|><|image_pad|>
<|vision_end|>``), and lists the images of the request in order of appearance, each with the
data URL as sent (the engine gets those, see ``webapp.core``). An image is decoded as pixels
only the first time a session sees its hash, and an image part whose data URL the session has
committed before is recognised by the digest of that text alone (:func:`url_key`), without
decoding its base64 again (an agent resends every earlier screenshot each turn): the caller
passes the images it holds and the URL digests it has learned.

Refused with a 400 naming the reason (``webapp.session_errors.ImageRefused`` subclasses):
a URL that is not a ``data:image/jpeg|png;base64`` URL (nothing is ever fetched), data that is
not base64, bytes that do not decode as a JPEG or PNG (or a shape the vision rule cannot
process), an image over ``max_image_bytes`` (decoded bytes) or :data:`MAX_IMAGE_PIXELS`, more
than ``max_images`` images in one request, and an image in a message that is not ``user`` or
``tool``.

Token counts (:class:`QwenVLRule`): an image becomes ``tokens(width, height)`` pad tokens
between the vision start/end tokens, Qwen2-VL / Qwen2.5-VL's rule (transformers'
``smart_resize``): each side rounded to a multiple of ``patch_size * merge_size`` (28), the
area then scaled into ``[min_pixels, max_pixels]``, and ``(h / 28) * (w / 28)`` tokens. The
rule is the replaceable part of a tokenizer's :class:`Vision`: any object with ``tokens(width,
height) -> int`` serves (a model with another processor brings its own).
"""

from __future__ import annotations

import binascii
import contextlib
import hashlib
import io
import math
import re
from array import array
from collections import ChainMap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pybase64
from blake3 import blake3

from webapp.bulk import bulk_lane
from webapp.limits import URLBytes, require_positive
from webapp.session_errors import (
    ImageNotBase64,
    ImageRefused,
    ImageTooLarge,
    ImageUndecodable,
    InvalidField,
    RemoteImageURL,
    TooManyImages,
)

__all__ = [
    "DEFAULT_MAX_IMAGES",
    "DEFAULT_MAX_IMAGE_BYTES",
    "IMAGE_REF_PREFIX",
    "MAX_IMAGE_PIXELS",
    "DecodedImage",
    "ImageLimits",
    "ImageTokenRule",
    "QwenVLRule",
    "RequestImages",
    "SessionImage",
    "Vision",
    "decode_data_url",
    "extract_images",
    "image_refs",
    "wire_messages",
]

DEFAULT_MAX_IMAGE_BYTES = 16 << 20  # a lossless 4K screenshot is ~10-20 MiB; JPEGs far less
DEFAULT_MAX_IMAGES = 1024  # per request: an agent resending a long episode's screenshots (the body cap bounds the bytes)
# Pixels decoded for one image: a small PNG can claim 100k x 100k (a decompression bomb).
MAX_IMAGE_PIXELS = 64_000_000
IMAGE_REF_PREFIX = "sha256:"
IMAGE_ROLES = ("user", "tool")
CLIENT_PART_TYPES = ("text", "image_url")
_DATA_URL = re.compile(r"data:(image/(?:jpeg|jpg|png));base64,", re.IGNORECASE)
_FORMATS = {"JPEG": "image/jpeg", "PNG": "image/png"}


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_images: int = DEFAULT_MAX_IMAGES

    def __post_init__(self) -> None:
        require_positive(self)


@dataclass(frozen=True, eq=False)
class DecodedImage:
    """One image as the session stores it: content-addressed by the sha256 of its bytes."""

    sha256: str
    mime_type: str
    width: int
    height: int
    data: bytes  # the file bytes as the client sent them (JPEG or PNG)

    @property
    def ref(self) -> str:
        return IMAGE_REF_PREFIX + self.sha256


class SessionImage(Protocol):
    """An image a session holds: decoded from a request (:class:`DecodedImage`) or committed to
    its journal (``webapp.journal.StoredImage``, its bytes read from the file)."""

    @property
    def sha256(self) -> str: ...

    @property
    def mime_type(self) -> str: ...

    @property
    def width(self) -> int: ...

    @property
    def height(self) -> int: ...

    @property
    def data(self) -> bytes: ...

    @property
    def ref(self) -> str: ...


@dataclass(frozen=True)
class RequestImages:
    messages: list[Any]  # the request's messages, image parts replaced by reference parts
    # In order of appearance: the image, its data URL's text as sent (checked: ASCII, nothing
    # that JSON escapes), kept from hashing it to splice into the engine request: a view of the
    # request's body when the caller gave one (URLBytes), valid for the turn only.
    images: list[tuple[SessionImage, bytes | memoryview]]
    new: dict[str, DecodedImage]  # the images the session did not hold yet, by sha256
    # url_key(data URL) -> sha256 of each image part: the session remembers them once the turn
    # is committed, so the next turn recognises these parts by their text
    url_keys: dict[bytes, str] = field(default_factory=dict)


def url_key(text: bytes | memoryview) -> bytes:
    """The digest of an image part's data URL text (UTF-8; mime type and base64 payload: exactly
    the image's bytes), 32 bytes. BLAKE3 (collision resistant, as sha256): every known image's
    URL is hashed on every turn, ~3.4 MB at a 20-screenshot history, and its SIMD code does
    that in about a quarter of sha256's time here (docs/benchmarks.md section 33). Kept in
    memory only (a session learns its URLs again after a restart)."""
    return blake3(text).digest()


def decode_data_url(url: Any, where: str, limits: ImageLimits,
                    known: Mapping[str, SessionImage]) -> SessionImage:
    """One image part's URL -> the image; raises an :class:`ImageRefused` naming ``where``."""
    if not isinstance(url, str):
        raise InvalidField(f"{where}.image_url.url", "expected a string")
    match = _DATA_URL.match(url)
    if match is None:
        if not url.startswith("data:"):
            raise RemoteImageURL(where, "only data:image/jpeg|png;base64 URLs are accepted; the server never "
                                        "fetches an image")
        raise ImageUndecodable(where, "only image/jpeg and image/png data URLs (base64) are accepted")
    encoded = url[match.end():]
    if len(encoded) // 4 * 3 > limits.max_image_bytes + 2:
        raise ImageTooLarge(where, f"over max_image_bytes={limits.max_image_bytes} bytes")
    try:
        data = pybase64.b64decode(encoded, validate=True)  # binascii's checks, SIMD
    except (binascii.Error, ValueError):
        raise ImageNotBase64(where, "the data URL's payload is not base64") from None
    if len(data) > limits.max_image_bytes:
        raise ImageTooLarge(where, f"{len(data)} bytes, over max_image_bytes={limits.max_image_bytes}")
    digest = hashlib.sha256(data).hexdigest()
    seen = known.get(digest)
    if seen is not None:
        return seen
    return _decode(data, digest, where)


def _decode(data: bytes, digest: str, where: str) -> DecodedImage:
    from PIL import Image  # only when a session first sees an image

    try:
        with Image.open(io.BytesIO(data), formats=tuple(_FORMATS)) as img:
            width, height = img.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ImageTooLarge(where, f"{width}x{height} pixels, over {MAX_IMAGE_PIXELS}")
            if img.format == "JPEG":
                # libjpeg's DCT scaling: every scan's entropy-coded data is still decoded (a
                # truncated file fails as before), only at 1/8 of the size (~3x less CPU).
                img.draft(img.mode, (width // 8, height // 8))
            img.load()  # the whole image: a truncated or corrupt file fails here, not in the engine
            mime = _FORMATS[img.format]
    except ImageRefused:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageUndecodable(where, f"not a decodable JPEG or PNG ({type(exc).__name__})") from None
    if width < 1 or height < 1 or max(width, height) / min(width, height) > QwenVLRule.MAX_ASPECT:
        raise ImageUndecodable(where, f"{width}x{height}: aspect ratio over {QwenVLRule.MAX_ASPECT}")
    return DecodedImage(digest, mime, width, height, data)


def extract_images(raw_messages: Any, limits: ImageLimits, known: Mapping[str, SessionImage],
                   known_urls: Mapping[bytes, str] | None = None, url_bytes: URLBytes | None = None) -> RequestImages:
    """The request's image parts checked and replaced by reference parts (see the module doc).

    ``known_urls``: :func:`url_key` of data URLs the session committed -> the image's sha256; a
    part whose URL is among them and whose image ``known`` holds is not decoded again (it passed
    the same checks when it was first seen). ``url_bytes``: the URLs' text as the body's bytes
    (``webapp.limits.loads_strict_urls``), hashed and kept as they are instead of encoding each
    URL again. Malformed messages pass through untouched (the turn's own validation names them).
    """
    if not isinstance(raw_messages, list):
        return RequestImages(raw_messages, [], {})
    with contextlib.ExitStack() as lane:  # the image work: one request's at a time (webapp.bulk)
        return _extract(raw_messages, limits, known, known_urls, url_bytes or URLBytes(), lane)


def _extract(raw_messages: list[Any], limits: ImageLimits, known: Mapping[str, SessionImage],
             known_urls: Mapping[bytes, str] | None, url_bytes: URLBytes, lane: contextlib.ExitStack) -> RequestImages:
    messages: list[Any] = []
    images: list[tuple[SessionImage, bytes | memoryview]] = []
    new: dict[str, DecodedImage] = {}
    keys: dict[bytes, str] = {}
    parts_seen = False
    for i, message in enumerate(raw_messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            messages.append(message)
            continue
        for j, part in enumerate(content):
            # Only the server makes reference parts: a client's ``type: image`` would forge one.
            if isinstance(part, dict) and part.get("type") not in CLIENT_PART_TYPES:
                raise InvalidField(f"messages[{i}].content[{j}].type",
                                   f"expected one of {', '.join(CLIENT_PART_TYPES)}")
        if not any(_is_image_part(p) for p in content):
            messages.append(message)
            continue
        if message.get("role") not in IMAGE_ROLES:
            raise InvalidField(f"messages[{i}].content", "images are accepted in user and tool messages only")
        if not parts_seen:  # the turn's image work starts: the process's small requests first
            parts_seen = True
            lane.enter_context(bulk_lane())
        parts = []
        for j, part in enumerate(content):
            if not _is_image_part(part):
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}]"
            if len(images) >= limits.max_images:
                raise TooManyImages(where, f"more than max_images={limits.max_images} images in one request")
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            text: bytes | memoryview = b""
            if isinstance(url, str):
                text = url_bytes.get(url) or url.encode("utf-8", "surrogatepass")
            key = url_key(text) if text else b""
            # Lookups, never iterations: ``known`` and ``known_urls`` may grow meanwhile (another
            # turn committing).
            digest = known_urls.get(key) if known_urls is not None and key else None
            seen = known.get(digest) if digest is not None else None
            # typeshed's ChainMap takes MutableMappings only; this one is only read (get).
            image = seen or decode_data_url(url, where, limits, ChainMap(new, known))  # type: ignore[arg-type]
            keys[key] = image.sha256
            if image.sha256 not in known:
                # known never loses an image: one not in it came from new or was decoded now
                assert isinstance(image, DecodedImage)
                new[image.sha256] = image
            images.append((image, text))
            parts.append({"type": "image", "image": image.ref, "width": image.width, "height": image.height})
        messages.append({**message, "content": parts})
    return RequestImages(messages, images, new, keys)


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def image_refs(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The reference parts of ``messages`` (normalized), in order of appearance."""
    return [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if part.get("type") == "image"]


class ImageTokenRule(Protocol):
    def tokens(self, width: int, height: int) -> int: ...


@dataclass(frozen=True)
class QwenVLRule:
    """Qwen2-VL / Qwen2.5-VL's image token count (transformers' ``smart_resize``).

    Defaults: Qwen2-VL's ``preprocessor_config.json`` (``min_pixels`` 3136, ``max_pixels``
    12845056, ``patch_size`` 14, ``merge_size`` 2).
    """

    MAX_ASPECT = 200  # the processor refuses a longer side over 200 x the shorter

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 14 * 14 * 4 * 16384

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """``(height, width)`` the processor resizes to: multiples of :attr:`factor`."""
        factor = self.factor
        h_bar = round(height / factor) * factor  # Python's round, as transformers: half to even
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def tokens(self, width: int, height: int) -> int:
        h_bar, w_bar = self.resized(width, height)
        return (h_bar // self.factor) * (w_bar // self.factor)

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> QwenVLRule:
        """The rule of a model's ``preprocessor_config.json`` (``min_pixels``/``max_pixels``,
        or the newer ``size: {shortest_edge, longest_edge}``; ``patch_size``, ``merge_size``)."""
        given = config.get("size")
        size = given if isinstance(given, dict) else {}
        default = cls()
        return cls(patch_size=int(config.get("patch_size", default.patch_size)),
                   merge_size=int(config.get("merge_size", default.merge_size)),
                   min_pixels=int(config.get("min_pixels", size.get("shortest_edge", default.min_pixels))),
                   max_pixels=int(config.get("max_pixels", size.get("longest_edge", default.max_pixels))))


@dataclass(frozen=True)
class Vision:
    """A tokenizer's vision tokens and its image token rule.

    The chat template writes one ``pad`` token per image (between ``start`` and ``end``);
    :meth:`expand` repeats it to the rule's count. Text never encodes to a special token (see
    ``webapp.tokenizers.SpecialText``), so every pad in the encoded ids is the template's own.
    """

    start_id: int
    pad_id: int
    end_id: int
    rule: ImageTokenRule

    def expand(self, ids: Sequence[int], refs: Sequence[Mapping[str, Any]]) -> list[int]:
        """``ids`` with the k-th pad token repeated for the k-th image of ``refs``."""
        found = ids.count(self.pad_id)  # at C speed: a long session's first records GET renders it all
        if found != len(refs):
            raise InvalidField("messages", f"the chat template renders {found} image placeholders for "
                                           f"{len(refs)} images (an image where the template drops it?)")
        if not refs:
            return list(ids)
        out: list[int] = []
        k = 0
        for tid in ids:
            if tid == self.pad_id:
                ref = refs[k]
                out.extend([tid] * self.rule.tokens(ref["width"], ref["height"]))
                k += 1
            else:
                out.append(tid)
        return out

    def pad_runs(self, ids: Sequence[int]) -> int:
        """The number of images in ``ids``: runs of pad tokens opened by ``start``."""
        try:  # the pair (start, pad) found at C speed in the ids packed as int64
            packed = array("q", ids).tobytes()
        except (OverflowError, TypeError):
            packed = None
        if packed is not None:
            pair = array("q", (self.start_id, self.pad_id)).tobytes()
            runs, at = 0, packed.find(pair)
            while at >= 0:
                runs += at % 8 == 0  # an id boundary (ids are whole 8-byte words)
                at = packed.find(pair, at + 1)
            return runs
        runs, previous = 0, None
        for tid in ids:
            if tid == self.pad_id and previous == self.start_id:
                runs += 1
            previous = tid
        return runs


def wire_messages(messages: Sequence[Any]) -> list[Any]:
    """``messages`` (with reference parts) in OpenAI's shape for the engine and the records:
    each image part ``{"type": "image_url", "image_url": {"url": "sha256:<hex>"}}``."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            m = {**m, "content": [{"type": "image_url", "image_url": {"url": p["image"]}}
                                  if isinstance(p, dict) and p.get("type") == "image" else p for p in content]}
        out.append(m)
    return out
