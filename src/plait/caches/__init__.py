"""Caches that stay correct across instances (SPEC §7): `@instance.caches.cached()`
functions, invalidated after commit here and through the `caches` stream everywhere."""

from plait.caches.cache import Cache
from plait.caches.cached import CachedFunction
from plait.caches.invalidations import CACHES_STREAM, Invalidation
from plait.caches.registry import CacheRegistry

__all__ = ["CACHES_STREAM", "Cache", "CacheRegistry", "CachedFunction", "Invalidation"]
