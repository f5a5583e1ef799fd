"""The live-fleet frame batch, declared once: what ``shinken_sync.fleet_view.FleetPublisher``
sends and ``webapp.viewer_fleet`` reads (``POST /ui/api/fleets/<id>/frames``). Imports nothing,
so the session server may use it without the SDK's client.

A batch is ``u32 big-endian header length``, the header (JSON ``{"frames": [{"tile_id", "mime",
"width", "height", "length"}]}``), then each frame's bytes in the header's order. One request
carries every tile's newest frame: a grid of 64 screens costs one request per flush, not 64.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_HEADER_BYTES", "BatchError", "FrameItem", "decode_batch", "encode_batch"]

MAX_HEADER_BYTES = 1 << 20
_LENGTH = struct.Struct(">I")


class BatchError(ValueError):
    """A frame batch that does not parse; nothing of it is taken."""


@dataclass(frozen=True)
class FrameItem:
    tile_id: str
    mime: str
    width: int
    height: int
    data: bytes


def encode_batch(frames: Sequence[FrameItem]) -> bytes:
    header = json.dumps({"frames": [{"tile_id": f.tile_id, "mime": f.mime, "width": f.width, "height": f.height,
                                     "length": len(f.data)} for f in frames]}, separators=(",", ":")).encode()
    return b"".join([_LENGTH.pack(len(header)), header, *(f.data for f in frames)])


def decode_batch(body: bytes, max_frames: int) -> list[FrameItem]:
    if len(body) < _LENGTH.size:
        raise BatchError("a frame batch starts with its header's length")
    (size,) = _LENGTH.unpack_from(body)
    if size > MAX_HEADER_BYTES or _LENGTH.size + size > len(body):
        raise BatchError(f"header length {size} does not fit the batch")
    try:
        header = json.loads(body[_LENGTH.size:_LENGTH.size + size])
        entries = header["frames"]
    except (ValueError, KeyError, TypeError):
        raise BatchError("the batch header is not {\"frames\": [...]}") from None
    if not isinstance(entries, list) or len(entries) > max_frames:
        raise BatchError(f"a batch holds 0..{max_frames} frames")
    out, at = [], _LENGTH.size + size
    for e in entries:
        if not (isinstance(e, dict) and isinstance(e.get("tile_id"), str) and isinstance(e.get("mime"), str)
                and all(type(e.get(k)) is int and e[k] >= 0 for k in ("width", "height", "length"))):
            raise BatchError("each frame needs tile_id, mime, and non-negative integer width, height, length")
        end = at + e["length"]
        if end > len(body):
            raise BatchError("the batch is shorter than its header says")
        out.append(FrameItem(e["tile_id"], e["mime"], e["width"], e["height"], body[at:end]))
        at = end
    if at != len(body):
        raise BatchError(f"{len(body) - at} bytes after the last frame")
    return out
