"""How kload's messages begin: with ``kload: ``, added here and nowhere else.

The texts are written without it. KloadError adds it to its message, the
``kload`` logger's filter to every record (installed when this module is
imported, which kload/__init__.py does first), the progress display (``say``, a
build's summary line) to what it shows, and ``msg()`` to anything else: a
builtin exception's message, a line printed by the CLI. Each is idempotent, so a
message that passes through two of them (an error logged, then raised) carries
the prefix once. On the hit path (api, options, knobs and handle raise with
``msg()``): +0.1 ms to a warm first use (benchmarks/warm_ab.py).
"""
from __future__ import annotations

import logging

PREFIX = "kload: "


def msg(text: str) -> str:
    """``text`` as kload says it: with the prefix, once."""
    return text if text.startswith(PREFIX) else PREFIX + text


def prefixed(record: logging.LogRecord) -> bool:
    """The ``kload`` logger's filter: gives a record the prefix, formatting it once."""
    text = record.getMessage()
    if not text.startswith(PREFIX):
        record.msg, record.args = PREFIX + text, None
    return True


_log = logging.getLogger("kload")
if prefixed not in _log.filters:
    _log.addFilter(prefixed)
