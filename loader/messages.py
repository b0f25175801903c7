"""How kload's messages begin: with ``kload: ``, added here and nowhere else.

The texts are written without it. KloadError adds it to its message, the
``kload`` logger's filter to every record, the progress display (``say``, a
build's summary line) to what it shows, and ``msg()`` to anything else: a
builtin exception's message, a line printed by the CLI. Each is idempotent, so a
message that passes through two of them (an error logged, then raised) carries
the prefix once. Imported first by every path, the hit path included (it is small).
"""
from __future__ import annotations

import logging

PREFIX = "kload: "


def msg(text: str) -> str:
    """``text`` as kload says it: with the prefix, once."""
    return text if text.startswith(PREFIX) else PREFIX + text


class _Prefixed(logging.Filter):
    """Gives each record of the ``kload`` logger the prefix (formatting it, once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.startswith(PREFIX):
            record.msg, record.args = PREFIX + text, None
        return True


_log = logging.getLogger("kload")
if not any(isinstance(f, _Prefixed) for f in _log.filters):
    _log.addFilter(_Prefixed())
