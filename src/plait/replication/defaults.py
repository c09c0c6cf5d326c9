"""The replication layer's defaults and limits, in one place: the components' own
arguments and the configuration file's (`replication.*`) take them from here. No
imports, so the configuration reads them without loading the transports."""

from __future__ import annotations

# The transports' (`replication.redis`, `replication.tcp`) are their options models':
# `redis_options.py`, `tcp_options.py`.

# The handler's (`replication.catch_up_page`, ...) are its options model's:
# `handler_options.py`.

MAX_PAGE_LIMIT = 10_000  # the most rows one HTTP catch-up request may ask for
