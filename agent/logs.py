"""Logging to stderr: text for people and journald, or one JSON object per line for shippers.

Under systemd, stderr goes to the journal, which stamps every line itself and
understands a "<N>" priority prefix (sd-daemon(3)); so there the text format
drops its timestamp and carries the priority instead, and `journalctl -p
warning` works.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import TextIO

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

# sd-daemon(3) priorities: <3> error, <4> warning, <6> info, <7> debug.
_SD_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def stream_is_journal(stream: TextIO) -> bool:
    """True if `stream` is the journal stream systemd connected (JOURNAL_STREAM=dev:inode)."""
    want = os.environ.get("JOURNAL_STREAM", "")
    if not want:
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


class _JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prio = _SD_PRIORITY.get(record.levelno, 6)
        # Every line of a multi-line message (tracebacks) is its own journal entry: prefix each.
        return "\n".join(f"<{prio}>{line}" for line in super().format(record).split("\n"))


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Configure the root logger (replacing its handlers). level: debug|info|warning|error; fmt: text|json."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    elif fmt == "text":
        if stream_is_journal(stream):
            handler.setFormatter(_JournalFormatter("%(levelname)s %(name)s: %(message)s"))
        else:
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(LEVELS[level])


class WarnOnce:
    """log.warning a message the first time its key comes, never again: a read that fails at
    every collection is said once, not every few seconds."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.said: set[str] = set()

    def __call__(self, key: str, msg: str, *args: object) -> None:
        if key not in self.said:
            self.said.add(key)
            self.logger.warning(msg, *args)


# A size as people read it: log lines, finding summaries (detectors), trace output.
def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
