"""Typed results of ``AsyncSandbox`` calls (and so of the blocking ``Sandbox``).

Plain frozen dataclasses: cheap to build on the loop thread, safe to hand to
another thread, and printable. Image payloads are ``bytes`` owned by the
result (copied once out of the received WebSocket message, which is then
freed).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import protocol

if TYPE_CHECKING:
    from PIL import Image


@dataclass(frozen=True, kw_only=True)
class Screenshot:
    """An encoded screen image and how it maps back to the screen.

    The daemon captured the screen region starting at ``(x0, y0)`` and scaled
    it down by ``scale`` (screen pixels per image pixel, >= 1.0), so image
    pixel ``(x, y)`` shows screen pixel ``(x0 + x * scale, y0 + y * scale)``.
    ``pointer`` says whether the pixels show the mouse pointer where it lies
    (False: they never do; ask :meth:`~shinken_sync.client.AsyncSandbox.cursor`).
    """

    data: bytes = field(repr=False)
    format: str
    width: int
    height: int
    scale: float = 1.0
    x0: int = 0
    y0: int = 0
    pointer: bool = False

    def to_image(self) -> Image.Image:
        """Decode into a Pillow image (imported lazily: decoding is optional)."""
        from PIL import Image

        image = Image.open(io.BytesIO(self.data))
        image.load()
        return image

    def to_screen(self, x: float, y: float) -> tuple[int, int]:
        """Map image coordinates to the screen coordinates ``click`` expects."""
        return (round(self.x0 + x * self.scale), round(self.y0 + y * self.scale))

    @classmethod
    def _from_wire(cls, meta: dict[str, Any], image: bytes | memoryview) -> Screenshot:
        return cls(
            data=bytes(image),
            format=meta["format"],
            width=meta["width"],
            height=meta["height"],
            scale=float(meta.get("scale", 1.0)),
            x0=int(meta.get("x0", 0)),
            y0=int(meta.get("y0", 0)),
            pointer=meta.get("pointer") is True,
        )


@dataclass(frozen=True, kw_only=True)
class Frame(Screenshot):
    """One screencast frame: a :class:`Screenshot` plus its place in the stream.

    ``seq`` counts from 1 over the stream's whole life, across resumes.
    ``gap`` is how many frames were missed right before this one (dropped by
    the local queue bound, evicted by the frame budget, or sent while the
    consumer was disconnected): ``seq - previous seq - 1``.
    """

    stream_id: str
    seq: int
    ts: float = 0.0
    gap: int = 0

    @classmethod
    def _from_protocol(cls, frame: protocol.Frame, gap: int) -> Frame:
        return cls(
            data=bytes(frame.image),
            format=frame.format,
            width=frame.width,
            height=frame.height,
            scale=frame.scale,
            x0=frame.x0,
            y0=frame.y0,
            pointer=frame.pointer,
            stream_id=frame.stream_id,
            seq=frame.seq,
            ts=frame.ts,
            gap=gap,
        )


@dataclass(frozen=True, kw_only=True)
class ExecResult:
    """A finished shell command. Output beyond the daemon's caps is cut and flagged.

    ``exit_code`` is None when a signal killed the shell (``signal`` says which).
    ``stdout``/``stderr`` are ``str`` (UTF-8, undecodable bytes replaced), or
    ``bytes`` when the command ran with ``encoding="base64"``.
    """

    exit_code: int | None
    stdout: str | bytes
    stderr: str | bytes
    signal: int | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True, kw_only=True)
class StepRow:
    """One action's verdict inside ``step`` or ``act_batch``.

    ``outcome`` is one of ``ok | error | timeout | skipped | denied |
    connection_lost | sandbox_died`` (a dropped connection is
    ``connection_lost``; ``sandbox_died`` only when the provider or daemon
    says the sandbox is gone); ``result`` is the verb's typed result when ok, ``error`` the
    exception otherwise (branch on its class, or on ``outcome``).
    """

    index: int
    verb: str
    outcome: str
    result: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == protocol.OK


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """The rows of one ``step``/``act_batch``, and the fused observation.

    ``observation`` is the post-action :class:`Screenshot` when ``observe`` was
    asked for and succeeded; ``observation_error`` says why it is missing
    otherwise.
    """

    rows: tuple[StepRow, ...]
    observation: Screenshot | None = None
    observation_error: BaseException | None = None

    @property
    def ok(self) -> bool:
        """Every action succeeded, and the observation too if one was asked for."""
        return all(row.ok for row in self.rows) and self.observation_error is None

    @property
    def outcomes(self) -> list[str]:
        return [row.outcome for row in self.rows]
