"""`plait serve --log-format json`: one JSON object per log record, for log pipelines.

Fields: `time` (ISO 8601, UTC, milliseconds), `level`, `logger`, `message`, `instance`,
`stream` where the record is about one (given as `extra={"stream": ...}`, or read from
the message: plait's own say "stream NAME: ..."), and `error` (the exception with its
traceback) where there is one.
"""

from __future__ import annotations

import datetime
import json
import logging
import re

_ABOUT_A_STREAM = re.compile(r"stream '?([^'\s:]+)'?:")


class JsonLines(logging.Formatter):
    """A record as one line of JSON (no newline inside: messages are escaped)."""

    def __init__(self, instance: str) -> None:
        super().__init__()
        self.instance = instance

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        at = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        out: dict[str, str] = {
            "time": at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": message,
            "instance": self.instance,
        }
        stream = getattr(record, "stream", None) or stream_of(message)
        if stream:
            out["stream"] = str(stream)
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def stream_of(message: str) -> str | None:
    """The stream a message of plait's is about ("stream events: ...")."""
    found = _ABOUT_A_STREAM.match(message)
    return found.group(1) if found else None
