"""Text that another process wrote, made safe to show in an exception, a log line or a terminal.

Owns ``safe_text`` (one string: control characters made visible, length bounded) and
``safe_data`` (the same for every string of a decoded structure, keys included, so that it
can be printed as text or as JSON), and the bounds they apply.

Does not own where peer text comes from (the protocol codec, the roster file, the peers'
records in the store) nor what it means; the callers apply these functions at the point
where such text enters this process's messages.

[Note: peer text]
Whatever answers on a daemon's socket, whatever a client sends the daemon, a roster file
and a peer rank's record in the store are written by another process, which may be of
another version, buggy or hostile. Printed verbatim, an escape sequence in it (``ESC [2J``
clears the screen, others retitle the terminal or forge what it shows) acts on the user's
terminal, a newline forges a log record of its own, and a megabyte of text floods both. So:

- Every character that ``str.isprintable()`` rejects becomes the escape ``repr`` would
  write: C0 controls, DEL, C1 controls, and also Unicode format characters (bidirectional
  overrides), line and paragraph separators and unassigned code points. ``\\n``, ``\\r`` and
  ``\\t`` are shown as such; the others as ``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``. Printable
  text, non-ASCII included (a host name with accents), stays as it is.
- Newlines are escaped too, for the text CLI as well: no message of the daemon has more
  than one line, ``hybridps status`` reports an error in one line on stderr, and a log
  record is one line; a newline from a peer could only forge a line that seems to be ours.
- A backslash is kept as it is (not doubled, unlike ``repr``): text made safe once is
  unchanged when made safe again, so a message that crosses several boundaries (daemon,
  client stub, CLI) is escaped once and cut at most once. The price is that a literal
  ``\\x1b`` in a peer's text reads like an escaped ESC; the text is for reading, not parsing.
- The length is bounded: beyond ``max_chars`` the text is cut and ends with
  ``... [+N chars]``, N counting the characters of the original that are not shown, so
  the result (marker included) is never longer than ``max_chars``.
"""

from __future__ import annotations

import math

#: Free text from a peer (an error message): the same bound as an error reply on the wire
#: (protocol.MAX_ERROR_MESSAGE_CHARS), so a daemon's message is never cut twice.
MAX_PEER_TEXT_CHARS = 16 * 1024

#: A name or a short field from a peer (client id, host, device, op, status field): the
#: protocol's bound on a name.
MAX_PEER_NAME_CHARS = 256

#: Nesting of a structure that ``safe_data`` copies; deeper containers are described, not
#: copied (msgpack nests up to 1024 deep, beyond Python's recursion limit).
MAX_DATA_DEPTH = 32

_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

#: Room for the cut marker; safe_text refuses a bound too small to show anything with it.
_MIN_CHARS = 32


def safe_text(text: object, max_chars: int = MAX_PEER_TEXT_CHARS) -> str:
    """``text`` (``str()`` of it, when it is not a string) with its control characters made
    visible and at most ``max_chars`` characters long (see [Note: peer text])."""
    if max_chars < _MIN_CHARS:
        raise ValueError(f"max_chars={max_chars} leaves no room for the cut marker; at least {_MIN_CHARS}")
    if not isinstance(text, str):
        text = str(text)
    if len(text) <= max_chars and text.isprintable():
        return text  # the common case: nothing to escape or cut
    out: list[str] = []
    used = 0
    # Every shown character costs at least one of the budget, so only this many of the
    # original can be shown: a megabyte is never walked.
    for ch in text[: max_chars + 1]:
        shown = ch if ch.isprintable() else _escape(ch)
        used += len(shown)
        out.append(shown)
        if used > max_chars:
            break
    else:
        return "".join(out)  # all of it fits (a longer text would have run over the bound)
    # Cut so that the kept prefix and the marker fit in max_chars together.
    room = max_chars - len(_marker(len(text)))
    kept = 0
    shown_chars = 0
    for shown in out:
        if kept + len(shown) > room:
            break
        kept += len(shown)
        shown_chars += 1
    return "".join(out[:shown_chars]) + _marker(len(text) - shown_chars)


def safe_data(obj: object, max_chars: int = MAX_PEER_NAME_CHARS, *, _depth: int = 0) -> object:
    """A copy of a decoded structure (msgpack or JSON) fit to print as text or as JSON.

    Every string, map keys included, goes through ``safe_text(s, max_chars)``; lists and
    tuples become lists; ints, bools and None stay; a float stays when it is finite and
    becomes its text (``"nan"``, ``"inf"``) otherwise, which JSON cannot hold as a number;
    anything else (bytes, msgpack extension types) becomes the safe text of its ``repr``.
    """
    if isinstance(obj, str):
        return safe_text(obj, max_chars)
    if obj is None or isinstance(obj, (bool, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, (dict, list, tuple)):
        if _depth >= MAX_DATA_DEPTH:
            return f"<{type(obj).__name__} nested deeper than {MAX_DATA_DEPTH} levels>"
        if isinstance(obj, dict):
            return {safe_text(k, max_chars): safe_data(v, max_chars, _depth=_depth + 1) for k, v in obj.items()}
        return [safe_data(v, max_chars, _depth=_depth + 1) for v in obj]
    return safe_text(repr(obj), max_chars)


def _escape(ch: str) -> str:
    named = _NAMED_ESCAPES.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _marker(cut_chars: int) -> str:
    return f"... [+{cut_chars} chars]"
