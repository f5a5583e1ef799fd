"""What each ``shinken demo --display xvfb`` screen runs: a terminal program showing every input.

``shinken demo`` starts ``xterm -e python -m shinken_sync.demo.screen N`` on each X screen
(:func:`xterm_argv`). The program puts the terminal in raw mode and turns on xterm's mouse
reporting (SGR encoding, mode 1006, so columns past 223 work), then prints one line per
input: typed text, a key by name, a click or a scroll with its cell, and marks a clicked
cell with ``+``. Every action the model takes therefore changes the screen, and the last
lines say what happened, which is what the contact sheet shows.

A shell would be the obvious terminal program, but it shows neither clicks nor scrolls, and
about a third of the reference model's actions are clicks.
"""

from __future__ import annotations

import os
import re
import sys
import termios
import tty
from collections.abc import Iterator

__all__ = ["describe_input", "key_name", "main", "xterm_argv"]

#: 10x20 cells fill a 1920x1080 screen with 192x54 of them.
XTERM_FONT = "10x20"
_MOUSE = re.compile(rb"\x1b\[<(\d+);(\d+);(\d+)([Mm])")
_CSI = re.compile(rb"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|O[@-~])?")
_NAMED = {b"\r": "Return", b"\n": "Return", b"\t": "Tab", b"\x7f": "BackSpace", b"\x08": "BackSpace",
          b"\x1b": "Escape"}
_BUTTONS = {0: "left click", 1: "middle click", 2: "right click", 64: "scroll up", 65: "scroll down"}
# xterm's key encoding (its ctlseqs: "PC-Style Function Keys"): CSI [1;mod] final or SS3 final for
# the cursor keys and F1-F4, CSI number [;mod] ~ for the others; mod - 1 is a bit set of
# shift (1), alt (2), ctrl (4), meta (8).
_FINAL_KEYS = {"A": "Up", "B": "Down", "C": "Right", "D": "Left", "H": "Home", "F": "End",
               "P": "F1", "Q": "F2", "R": "F3", "S": "F4"}
_TILDE_KEYS = {1: "Home", 2: "Insert", 3: "Delete", 4: "End", 5: "Prior", 6: "Next", 15: "F5", 17: "F6",
               18: "F7", 19: "F8", 20: "F9", 21: "F10", 23: "F11", 24: "F12"}
_MODIFIERS = ((4, "ctrl"), (2, "alt"), (1, "shift"), (8, "meta"))
_KEY_SEQ = re.compile(r"(?:\[(?:(\d+)(?:;(\d+))?)?([~A-DFHP-S])|O([A-DFHP-S]))")


def xterm_argv(screen_width: int, screen_height: int, title: str) -> list[str]:
    """The screen-filling xterm running this program, for shinkend's ``--launch``."""
    cols, rows = screen_width // 10, screen_height // 20
    return ["xterm", "-fn", XTERM_FONT, "-geometry", f"{cols}x{rows}+0+0", "-title", title,
            "-e", sys.executable, "-m", "shinken_sync.demo.screen", title]


def describe_input(data: bytes) -> Iterator[tuple[str, str, tuple[int, int] | None]]:
    """One ``(kind, detail, clicked cell or None)`` per input event in ``data`` (bytes from the
    terminal); kind is ``typed`` (detail: the text), ``key``, ``left click`` ... or ``scroll up/down``."""
    i, text = 0, bytearray()
    while i < len(data):
        mouse = _MOUSE.match(data, i)
        if (mouse or data[i:i + 1] in _NAMED or data[i] < 0x20) and text:
            yield "typed", bytes(text).decode(errors="replace"), None
            text.clear()
        if mouse:
            i = mouse.end()
            button, col, row, kind = int(mouse[1]), int(mouse[2]), int(mouse[3]), mouse[4]
            if kind == b"M" and button in _BUTTONS:  # presses only; a release repeats the click
                yield _BUTTONS[button], f"at column {col}, row {row}", (col, row) if button < 64 else None
            continue
        if data[i] == 0x1b:
            seq = _CSI.match(data, i)
            assert seq is not None  # the pattern matches a lone ESC too
            i = seq.end()
            yield "key", "Escape" if seq.group() == b"\x1b" else key_name(seq.group()[1:].decode(errors="replace")), None
            continue
        char = data[i:i + 1]
        i += 1
        if char in _NAMED:
            yield "key", _NAMED[char], None
        elif char[0] < 0x20:
            yield "key", f"ctrl+{chr(char[0] + 0x60)}", None
        else:
            text += char
    if text:
        yield "typed", bytes(text).decode(errors="replace"), None


def key_name(sequence: str) -> str:
    """The key an escape sequence (without its ESC) encodes, as xdotool names it: ``[1;3S`` is
    ``alt+F4``, ``[A`` is ``Up``; a sequence it does not know is shown as it came."""
    match = _KEY_SEQ.fullmatch(sequence)
    if match is None:
        return sequence
    number, modifier, final, ss3 = match.groups()
    if ss3 is not None:
        name = _FINAL_KEYS[ss3]
    elif final == "~":
        name = _TILDE_KEYS.get(int(number or 0), "")
        if not name:
            return sequence
    else:
        name = _FINAL_KEYS[final]
    bits = int(modifier) - 1 if modifier else 0
    return "+".join([*(label for bit, label in _MODIFIERS if bits & bit), name])


def main(argv: list[str] | None = None) -> int:
    title = (argv if argv is not None else sys.argv[1:]) or ["shinken demo"]
    fd_in, out = sys.stdin.fileno(), sys.stdout
    saved = termios.tcgetattr(fd_in)
    tty.setraw(fd_in)
    # Mouse presses and releases (1000) in SGR encoding (1006); no cursor blink, so a screen
    # changes only when an input arrives.
    out.write("\x1b[?1000h\x1b[?1006h\x1b[?12l")
    out.write(f"{title[0]}: every click, scroll, key and typed text shows up below.\r\n\r\n")
    out.flush()
    count, typing = 0, None  # typing: the text of the last line, while it is a "typed" line
    try:
        while data := os.read(fd_in, 4096):
            for kind, detail, cell in describe_input(data):
                if kind == "typed" and typing is not None:
                    # xdotool types one character at a time: extend the line, not one line per character
                    typing += detail
                    out.write(f"\x1b[1A\r\x1b[2K{count:4d}  typed {typing!r}\r\n")
                    continue
                typing = detail if kind == "typed" else None
                count += 1
                shown = repr(detail) if kind == "typed" else detail
                out.write(f"{count:4d}  {kind} {shown}\r\n")
                if cell is not None:  # mark the cell: save cursor, go there, '+', restore
                    out.write(f"\x1b7\x1b[{cell[1]};{cell[0]}H+\x1b8")
            out.flush()
    finally:
        out.write("\x1b[?1006l\x1b[?1000l")
        out.flush()
        termios.tcsetattr(fd_in, termios.TCSADRAIN, saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
