"""The tests' own redis-server (used when `PLAIT_TEST_REDIS` is not set, and always by
tests that stop and start the server): the checker's, `plait.check.redis_server`."""

from __future__ import annotations

from plait.check.redis_server import RedisServer, redis_server_binary

__all__ = ["RedisServer", "redis_server_binary"]
