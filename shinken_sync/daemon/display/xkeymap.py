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

libxcb through ctypes: mss already loads it, and this needs a handful of
calls, not a dependency. Not libX11: its default I/O error handler calls
exit() when the server dies, which would take the whole daemon down.
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

_KeySym = ctypes.c_uint32


def keysym_for(char: str) -> int:
    """The X keysym of a character: Latin-1 maps to itself, the rest to 0x01000000 + code point."""
    code = ord(char)
    if 0x20 <= code <= 0x7E or 0xA0 <= code <= 0xFF:
        return code
    return 0x01000000 + code


class _Cookie(ctypes.Structure):
    _fields_ = [("sequence", ctypes.c_uint)]


def _load_xcb() -> ctypes.CDLL:
    path = ctypes.util.find_library("xcb")
    if path is None:
        raise DisplayError("libxcb not found (apt-get install libxcb1)", ERR_FAILED)
    xcb = ctypes.CDLL(path)
    xcb.xcb_connect.restype = ctypes.c_void_p
    xcb.xcb_connect.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
    xcb.xcb_connection_has_error.argtypes = [ctypes.c_void_p]
    xcb.xcb_disconnect.argtypes = [ctypes.c_void_p]
    xcb.xcb_get_setup.restype = ctypes.POINTER(ctypes.c_uint8)
    xcb.xcb_get_setup.argtypes = [ctypes.c_void_p]
    xcb.xcb_get_keyboard_mapping.restype = _Cookie
    xcb.xcb_get_keyboard_mapping.argtypes = [ctypes.c_void_p, ctypes.c_uint8, ctypes.c_uint8]
    xcb.xcb_get_keyboard_mapping_reply.restype = ctypes.POINTER(ctypes.c_uint8)
    xcb.xcb_get_keyboard_mapping_reply.argtypes = [ctypes.c_void_p, _Cookie, ctypes.c_void_p]
    xcb.xcb_change_keyboard_mapping_checked.restype = _Cookie
    xcb.xcb_change_keyboard_mapping_checked.argtypes = [
        ctypes.c_void_p, ctypes.c_uint8, ctypes.c_uint8, ctypes.c_uint8, ctypes.POINTER(_KeySym)
    ]
    xcb.xcb_request_check.restype = ctypes.c_void_p
    xcb.xcb_request_check.argtypes = [ctypes.c_void_p, _Cookie]
    return xcb


_libc = ctypes.CDLL(None)
_libc.free.argtypes = [ctypes.c_void_p]
#: Offsets in xcb_setup_t and xcb_get_keyboard_mapping_reply_t (X protocol layout).
_SETUP_MIN_KEYCODE = 34
_REPLY_KEYSYMS_PER_KEYCODE = 1
_REPLY_HEADER = 32


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
        used: set[int]
        bindings: dict[int, int]
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
        self._xcb = _load_xcb()
        self._conn = self._xcb.xcb_connect(display_name.encode(), None)
        if self._xcb.xcb_connection_has_error(self._conn):
            self.close()
            raise DisplayError(f"cannot connect to X display {display_name}", ERR_FAILED)
        setup = self._xcb.xcb_get_setup(self._conn)
        low, high = setup[_SETUP_MIN_KEYCODE], setup[_SETUP_MIN_KEYCODE + 1]
        count = high - low + 1
        cookie = self._xcb.xcb_get_keyboard_mapping(self._conn, low, count)
        reply = self._xcb.xcb_get_keyboard_mapping_reply(self._conn, cookie, None)
        if not reply:
            self.close()
            raise DisplayError(f"cannot read the keymap of {display_name}", ERR_FAILED)
        try:
            per = reply[_REPLY_KEYSYMS_PER_KEYCODE]
            table = ctypes.cast(ctypes.addressof(reply.contents) + _REPLY_HEADER, ctypes.POINTER(ctypes.c_uint32))
            syms = [table[i] for i in range(count * per)]
        finally:
            _libc.free(reply)
        spare = [low + i for i in range(count) if not any(syms[i * per : (i + 1) * per])]
        self.pool = KeycodePool({s for s in syms if s}, spare)
        #: The keymap as this connection last set it: the first keycode, keysyms per
        #: keycode, and every keycode's keysyms in a row.
        self._low, self._per, self._table = low, per, syms

    def bind(self, bindings: dict[int, int]) -> None:
        """Bind keycode -> keysym on the server; returns once the server did it.

        ONE request for all of them (the span from the lowest to the highest keycode,
        the others rewritten as they are): every request makes the server send each
        client a MappingNotify, and a window manager re-grabs its keys on each one.
        openbox, sent one per character of a 40-character Unicode text, fell seconds
        behind, holding the pointer frozen in its click grab meanwhile (clicks and
        drags right after the typing did not move the pointer).
        """
        if not bindings:
            return
        low, per = self._low, self._per
        for keycode, keysym in bindings.items():
            row = (keycode - low) * per
            self._table[row : row + per] = [keysym] + [0] * (per - 1)
        first, last = min(bindings), max(bindings)
        span = self._table[(first - low) * per : (last - low + 1) * per]
        keysyms = (_KeySym * len(span))(*span)
        cookie = self._xcb.xcb_change_keyboard_mapping_checked(self._conn, last - first + 1, first, per, keysyms)
        error = self._xcb.xcb_request_check(self._conn, cookie)
        if error:
            _libc.free(error)
            raise DisplayError(f"binding keycodes {first}..{last} failed", ERR_FAILED)
        if self._xcb.xcb_connection_has_error(self._conn):
            raise DisplayError("the X connection broke while binding keycodes", ERR_FAILED)

    def close(self) -> None:
        if self._conn:
            self._xcb.xcb_disconnect(self._conn)
            self._conn = None
