"""The replication layer's defaults and limits, in one place: the components' own
arguments and the configuration file's (`replication.*`) take them from here. No
imports, so the configuration reads them without loading the transports."""

from __future__ import annotations

# The transports' (`replication.redis`, `replication.tcp`) are their options models':
# `redis_options.py`, `tcp_options.py`.

# Catch-up (`replication.catch_up_page`, `catch_up_page_max`): pages double after
# every full page up to the largest, so a reader that missed a few rows reads them in
# one small query, and one that missed a million in ~100.
CATCH_UP_PAGE = 100
CATCH_UP_PAGE_MAX = 10_000
MAX_PAGE_LIMIT = 10_000  # the most rows one HTTP catch-up request may ask for
