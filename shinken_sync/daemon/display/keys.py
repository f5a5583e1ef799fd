"""Key combinations (``ctrl+shift+t``, ``Return``, ``a``), parsed once for every backend.

An ACI ``key`` argument is ``+``-separated: zero or more modifiers, then one
key. Names are case-insensitive where X keysyms allow it, and the common
aliases agents use (``enter``, ``esc``, ``cmd``, ``pageup``) map to the X
keysym names xdotool understands, so the virtual display and Xvfb agree on
what a combo means.
"""

from __future__ import annotations

from dataclasses import dataclass

from shinken_sync.protocol import ERR_BAD_ARGS

from .base import DisplayError

#: Canonical modifier names (xdotool's) by every accepted spelling.
MODIFIERS = {
    "ctrl": "ctrl",
    "control": "ctrl",
    "shift": "shift",
    "alt": "alt",
    "option": "alt",
    "super": "super",
    "win": "super",
    "cmd": "super",
    "command": "super",
    "meta": "super",
}

#: X keysym names by lower-case spelling, plus aliases.
_KEYSYMS = {
    "return": "Return",
    "enter": "Return",
    "backspace": "BackSpace",
    "tab": "Tab",
    "escape": "Escape",
    "esc": "Escape",
    "space": "space",
    "delete": "Delete",
    "del": "Delete",
    "insert": "Insert",
    "home": "Home",
    "end": "End",
    "up": "Up",
    "down": "Down",
    "left": "Left",
    "right": "Right",
    "pageup": "Prior",
    "page_up": "Prior",
    "prior": "Prior",
    "pagedown": "Next",
    "page_down": "Next",
    "next": "Next",
    "plus": "plus",
    "minus": "minus",
    **{f"f{n}": f"F{n}" for n in range(1, 13)},
}

MAX_COMBO_PARTS = 6


@dataclass(frozen=True)
class KeyCombo:
    modifiers: frozenset[str]
    #: An X keysym name (``Return``, ``BackSpace``, ``F5``) or one character.
    key: str

    @property
    def char(self) -> str | None:
        """The character this combo types, if it types one (no ctrl/alt/super)."""
        if self.modifiers - {"shift"}:
            return None
        if len(self.key) == 1:
            return self.key.upper() if "shift" in self.modifiers else self.key
        if self.key == "space":
            return " "
        return None

    def xdotool(self) -> str:
        """The combo in xdotool ``key`` syntax, modifiers in a fixed order."""
        order = [m for m in ("ctrl", "alt", "shift", "super") if m in self.modifiers]
        return "+".join([*order, self.key])

    def __str__(self) -> str:
        return self.xdotool()


def parse_combo(combo: str) -> KeyCombo:
    """Parse ``ctrl+shift+t``; raises :class:`DisplayError` (``bad_args``) if malformed.

    A lone ``+`` is the plus key; ``ctrl++`` is ctrl and plus.
    """
    if not isinstance(combo, str) or not combo.strip():
        raise DisplayError("key combo must be a non-empty string", ERR_BAD_ARGS)
    text = combo.strip()
    if text == "+":
        parts = ["plus"]
    elif text.endswith("++"):
        parts = text[:-2].split("+") + ["plus"]
    else:
        parts = text.split("+")
    if len(parts) > MAX_COMBO_PARTS or any(not p for p in parts):
        raise DisplayError(f"malformed key combo {combo!r}", ERR_BAD_ARGS)
    *mods, key = parts
    modifiers = set()
    for mod in mods:
        canonical = MODIFIERS.get(mod.lower())
        if canonical is None:
            raise DisplayError(f"unknown modifier {mod!r} in {combo!r}", ERR_BAD_ARGS)
        modifiers.add(canonical)
    if len(key) == 1:
        name = key
    else:
        known = _KEYSYMS.get(key.lower())
        if known is not None:
            name = known
        else:
            # Any other X keysym name (``KP_Enter``, ``XF86AudioMute``) passes through
            # as given: xdotool resolves it, the virtual display ignores it.
            if not key.replace("_", "").isalnum() or not key.isascii():
                raise DisplayError(f"unknown key {key!r} in {combo!r}", ERR_BAD_ARGS)
            name = key
    return KeyCombo(frozenset(modifiers), name)
