"""Logging setup: human-readable lines, or one JSON object per line (``PROBEGUARD_LOG_JSON``)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

__all__ = ["JsonFormatter", "StderrHandler", "configure_logging"]


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg"[, "exc"]}`` per record, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record.

    A plain ``StreamHandler`` keeps the stream it was created with; when that stream is
    replaced and closed (a test's captured stderr, a redirected CLI run), every later
    record from a background thread fails with "I/O operation on closed file".
    """

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it
        pass


def configure_logging(level: str = "INFO", *, json_lines: bool = False) -> None:
    handler = StderrHandler()
    handler.setFormatter(
        JsonFormatter()
        if json_lines
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    if level != "DEBUG":  # kafka-python logs every connection at INFO
        logging.getLogger("kafka").setLevel(logging.WARNING)
