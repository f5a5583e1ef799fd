"""Binding Unicode characters to spare X keycodes before xdotool types them.

``xdotool type`` types a character missing from the keymap by binding it to a
scratch keycode, pressing that key, and unbinding it right away. X clients look
keysyms up lazily, so a client that falls behind (xterm on a loaded machine)
reads the keycode after the unbinding and drops the character; we measured
'Grüße мир ✓ 日本' arriving as 'Grüße ми ✓ 日'. Binding every such character
to a spare keycode *beforehand*, and leaving it bound, means xdotool finds it
in the keymap and never remaps anything while keys are in flight.

Xvfb's default map has 19 spare keycodes. They are reused least recently
used first; :meth:`SpareKeycodes.plan` splits a text where reuse would hit a
keycode typed in the same chunk, and the caller lets the client catch up
(:data:`REBIND_SETTLE_S`) before rebinding.

libX11 through ctypes: it is present wherever Xvfb and xdotool are, and this
needs five calls, not a dependency.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
from dataclasses import dataclass

from shinken_sync.protocol import ERR_FAILED

from .base import DisplayError

#: Pause between chunks that rebind a keycode, so the client has read the
#: previous chunk's keys with their old meaning.
REBIND_SETTLE_S = 0.15
#: Spare keycodes left to xdotool's own scratch binding.
_KEEP_FREE = 1

_KeySym = ctypes.c_ulong


def keysym_for(char: str) -> int:
    """The X keysym of a character: Latin-1 maps to itself, the rest to 0x01000000 + code point."""
    code = ord(char)
    if 0x20 <= code <= 0x7E or 0xA0 <= code <= 0xFF:
        return code
    return 0x01000000 + code


def _load_x11() -> ctypes.CDLL:
    path = ctypes.util.find_library("X11")
    if path is None:
        raise DisplayError("libX11 not found (apt-get install libx11-6)", ERR_FAILED)
    x11 = ctypes.CDLL(path)
    x11.XOpenDisplay.restype = ctypes.c_void_p
    x11.XOpenDisplay.argtypes = [ctypes.c_char_p]
    x11.XCloseDisplay.argtypes = [ctypes.c_void_p]
    x11.XDisplayKeycodes.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    x11.XGetKeyboardMapping.restype = ctypes.POINTER(_KeySym)
    x11.XGetKeyboardMapping.argtypes = [ctypes.c_void_p, ctypes.c_ubyte, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    x11.XChangeKeyboardMapping.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_KeySym), ctypes.c_int
    ]
    x11.XSync.argtypes = [ctypes.c_void_p, ctypes.c_int]
    x11.XFree.argtypes = [ctypes.c_void_p]
    return x11


@dataclass(frozen=True)
class Chunk:
    text: str
    #: keycode -> keysym, bound right before the chunk is typed.
    bindings: dict[int, int]
    #: A binding replaces a character typed earlier: let the client catch up first.
    rebinds: bool


class KeycodePool:
    """Which spare keycode types which character; pure bookkeeping, no X."""

    def __init__(self, mapped_keysyms: set[int], spare_keycodes: list[int]):
        #: Keysyms the keymap already types; xdotool handles those itself.
        self._mapped = mapped_keysyms
        self._free = list(spare_keycodes[_KEEP_FREE:])
        #: char -> keycode, least recently typed first.
        self._bound: collections.OrderedDict[str, int] = collections.OrderedDict()

    def plan(self, text: str) -> list[Chunk]:
        """Split ``text`` into chunks to type in order, assigning keycodes.

        The caller applies each chunk's bindings with :meth:`SpareKeycodes.bind` right before
        typing it, after waiting :data:`REBIND_SETTLE_S` if the chunk
        ``rebinds`` a keycode that earlier keys used.
        """
        chunks: list[Chunk] = []
        start, used, bindings, rebinds = 0, set(), {}, False
        for index, char in enumerate(text):
            if not char.isprintable() or keysym_for(char) in self._mapped:
                continue
            keycode = self._bound.get(char)
            if keycode is not None:
                self._bound.move_to_end(char)
                used.add(keycode)
                continue
            if self._free:
                keycode = self._free.pop()
            elif self._bound:
                victim, keycode = next(iter(self._bound.items()))
                if keycode in used:
                    # Every bound keycode is typed in this chunk already: start a new one.
                    chunks.append(Chunk(text[start:index], bindings, rebinds))
                    start, used, bindings = index, set(), {}
                del self._bound[victim]
                rebinds = True
            else:
                continue  # no spare keycode at all: xdotool's own binding is all there is
            self._bound[char] = keycode
            bindings[keycode] = keysym_for(char)
            used.add(keycode)
        chunks.append(Chunk(text[start:], bindings, rebinds))
        return chunks

class SpareKeycodes:
    """The keymap of one X display: its spare keycodes and what is bound to them.

    Not thread-safe: the Xvfb display uses it from its X thread only.
    """

    def __init__(self, display_name: str):
        self._x11 = _load_x11()
        self._dpy = self._x11.XOpenDisplay(display_name.encode())
        if not self._dpy:
            raise DisplayError(f"cannot open X display {display_name}", ERR_FAILED)
        low, high = ctypes.c_int(), ctypes.c_int()
        self._x11.XDisplayKeycodes(self._dpy, ctypes.byref(low), ctypes.byref(high))
        count = high.value - low.value + 1
        per = ctypes.c_int()
        table = self._x11.XGetKeyboardMapping(self._dpy, low.value, count, ctypes.byref(per))
        try:
            syms = [table[i] for i in range(count * per.value)]
        finally:
            self._x11.XFree(table)
        spare = [low.value + i for i in range(count) if not any(syms[i * per.value : (i + 1) * per.value])]
        self.pool = KeycodePool({s for s in syms if s}, spare)

    def bind(self, bindings: dict[int, int]) -> None:
        """Bind keycode -> keysym on the server and wait until it took effect."""
        for keycode, keysym in bindings.items():
            sym = _KeySym(keysym)
            self._x11.XChangeKeyboardMapping(self._dpy, keycode, 1, ctypes.byref(sym), 1)
        if bindings:
            self._x11.XSync(self._dpy, 0)

    def close(self) -> None:
        if self._dpy:
            self._x11.XCloseDisplay(self._dpy)
            self._dpy = None
