"""What a checked process said when it failed: the line of its standard error (or of a
Spark query's error) that states the cause."""

from __future__ import annotations

import re

_ERROR_LINE = re.compile(
    r"^(?:[\w.]+(?:Error|Exception|Exit|Interrupt)\b|.*\b(?:ERROR|CRITICAL|FATAL)\b)"
)


def last_error(text: str) -> str:
    """The last line of a process's standard error that states an error: a Python
    exception's (`psycopg.OperationalError: ...`), or a log line at ERROR or worse;
    else its last line; "" when it said nothing."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.match(line):
            return line
    return lines[-1] if lines else ""


_EXCEPTION_LINE = re.compile(r"^\s*[\w.]+(?:Error|Exception)\b: ")


def error_line(error: str) -> str:
    """One line for an error's text (a Spark query's, with a Python traceback and Java
    frames inside): its first line, and the first Python exception line below it that
    is not Spark's or Py4J's wrapper (`plait.errors.ConfigError: ...`): the cause."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if not lines:
        return ""
    raised = [line for line in lines[1:] if _EXCEPTION_LINE.match(line)]
    # Spark's and Py4J's own exceptions wrap the one that was raised: skip them.
    causes = [line for line in raised if not line.startswith(("pyspark.", "py4j."))]
    cause = (causes or raised or [""])[0]
    return f"{lines[0]} ... {cause}" if cause else lines[0]


# Spark's own words when a Python worker it started did not connect back in time.
_WORKER_START_TIMEOUTS = (
    "Python worker failed to connect back",
    "waiting for the Python worker to connect back",
)


def worker_start_timed_out(error: str) -> bool:
    """Whether a Spark query failed because Spark gave up waiting for a Python worker it
    started (a fixed 10 s, which a loaded machine misses): restarted, not a death."""
    return any(phrase in error for phrase in _WORKER_START_TIMEOUTS)
