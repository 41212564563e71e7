"""Untrusted text made safe for a log line or a terminal (docs/logs.md, "Untrusted text").

A file name found on disk, a path from a request or a setting, a header: any of them may hold a
newline (which would split one log line into two, the second one forged), an ESC sequence (which
a terminal running `journalctl` or `tail -f` would obey), or bytes that are not UTF-8 (which
Python decodes to lone surrogates a UTF-8 log file cannot store). `printable` writes every
character that is not printable as a backslash escape, the way Python's `repr` does, and a
backslash as two, so an escaped string can always be told from one that only looks like it.
Printable non-ASCII text (accents, CJK) stays as it is. `one_line` is the log formatter's safety
net for every message (edge_llm/logsetup.py): the same escapes, backslashes kept, so text that
`printable` escaped passes through unchanged.
"""

from __future__ import annotations

import os

_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str | os.PathLike[str]) -> str:
    """`text` (a str or a path) with each non-printable character (C0 and C1 controls, DEL, ESC,
    line and paragraph separators, lone surrogates, ...) and each backslash escaped: one line,
    nothing a terminal interprets."""
    s = os.fspath(text)
    if s.isprintable() and "\\" not in s:
        return s
    return "".join(ch if ch.isprintable() and ch != "\\" else _escape(ch) for ch in s)


def one_line(text: str) -> str:
    """`text` with each non-printable character escaped as `printable` does, backslashes kept:
    a whole log message made one line (idempotent: its output holds only printable characters)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)
