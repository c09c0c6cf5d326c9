"""The replication layer's limits that several modules hold to. The components' defaults
and bounds live in their options models (`handler_options.py`, `redis_options.py`,
`tcp_options.py`), which the configuration extends."""

from __future__ import annotations

# The most rows one HTTP catch-up request may ask for; a catch-up page is no larger.
MAX_PAGE_LIMIT = 10_000
