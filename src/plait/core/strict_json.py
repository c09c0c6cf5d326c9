"""JSON from outside, read strictly: what RFC 8259 allows and nothing more. No I/O.

Python's `json.loads` also reads `NaN`, `Infinity` and numbers like `1e400` (as an
infinite float), none of which any JSON writer (plait's included: `allow_nan=False`)
can send back, and raises `RecursionError`, not `ValueError`, on deeply nested input.
`loads` turns all of those into one `ValueError` saying what was wrong, so a bad body
is a 400 and never a failure later on, when the value is written back out.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


# One decoder for every call: `json.loads` with options builds a new one each time.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite)


def loads(raw: str | bytes) -> Any:
    """The JSON value in `raw` (bytes: UTF-8); `ValueError` saying why for anything
    else (`UnicodeDecodeError` for bytes that are not UTF-8)."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    try:
        return _DECODER.decode(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
