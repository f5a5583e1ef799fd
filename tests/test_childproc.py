"""The ready-line helper every parent of our long-running children uses, against real pipes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shinken_sync.childproc import (
    ReadyLineBuffer,
    ReadyLineTimeout,
    ReadyLineTooLong,
    StdoutClosed,
    parse_ready_line,
    read_ready_line,
)


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)


def test_a_line_split_over_writes_is_read_whole_and_parsed():
    proc = _child("import sys, time; w = sys.stdout.buffer; w.write(b'{\"url\": \"http://127');"
                  "w.flush(); time.sleep(0.2); w.write(b'.0.0.1:1\"}\\nmore output\\n'); w.flush()")
    try:
        line = read_ready_line(proc.stdout.fileno(), 30)
        assert parse_ready_line(line) == {"url": "http://127.0.0.1:1"}
    finally:
        proc.wait(30)
        proc.stdout.close()


def test_a_child_that_exits_first_is_stdout_closed_and_a_silent_one_times_out():
    proc = _child("print('no newline at all', end='')")
    try:
        with pytest.raises(StdoutClosed):
            read_ready_line(proc.stdout.fileno(), 30)
    finally:
        proc.wait(30)
        proc.stdout.close()
    proc = _child("import time; time.sleep(30)")
    try:
        with pytest.raises(ReadyLineTimeout):
            read_ready_line(proc.stdout.fileno(), 0.3)
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()


def test_the_buffer_bounds_a_line_and_the_parser_takes_objects_only():
    buffer = ReadyLineBuffer(max_bytes=8)
    assert buffer.feed(b"1234") is None
    with pytest.raises(ReadyLineTooLong):
        buffer.feed(b"56789")
    assert ReadyLineBuffer().feed(b'{"a": 1}\n{"b"') == b'{"a": 1}'
    assert [parse_ready_line(x) for x in (b"[1]", b"not json", b'"s"', b'{"ready": true}')] == [
        None, None, None, {"ready": True}]


def test_a_pipe_read_after_eof_is_stdout_closed():
    read, write = os.pipe()
    os.close(write)
    try:
        with pytest.raises(StdoutClosed):
            read_ready_line(read, 5)
    finally:
        os.close(read)
