"""`CachedFunction`: an async function whose results are cached by its arguments.

The key is the tuple of the arguments in the order of the function's parameters, with
defaults filled in, so `f(1)`, `f(x=1)` and `f(1, y=None)` share one entry. Results
are shared between callers: treat them as read-only.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Generic, ParamSpec, TypeVar

from plait.caches.cache import Cache
from plait.caches.invalidations import Key
from plait.errors import ConfigError

P = ParamSpec("P")
V = TypeVar("V")

_ALLOWED = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.KEYWORD_ONLY,
)


class CachedFunction(Generic[P, V]):
    """Call it like the function it wraps; `.cache` is its `Cache`, named `.name`."""

    def __init__(self, function: Callable[P, Awaitable[V]], cache: Cache[V]) -> None:
        if not callable(function):
            raise ConfigError(f"cannot cache {function!r}: not callable")
        signature = inspect.signature(function)
        for parameter in signature.parameters.values():
            if parameter.kind not in _ALLOWED:
                raise ConfigError(
                    f"cannot cache {function.__qualname__}: its parameter "
                    f"{parameter.name!r} is *args or **kwargs, and a cache key needs a fixed "
                    "list of arguments"
                )
        functools.update_wrapper(self, function)
        self._function = function
        self._signature = signature
        self.arity = len(signature.parameters)
        self._all_positional = all(
            p.kind is not inspect.Parameter.KEYWORD_ONLY for p in signature.parameters.values()
        )
        self.cache = cache
        self.name = cache.name

    def key(self, *args: Any, **kwargs: Any) -> Key:
        """The cache key of a call with these arguments."""
        if not kwargs and len(args) == self.arity and self._all_positional:
            return args
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{self.name}: {err}") from None
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> V:
        if not kwargs and len(args) == self.arity and self._all_positional:
            key: Key = args  # the common case, without binding
        else:
            key = self.key(*args, **kwargs)
        return await self.cache.get_or_load(key, lambda: self._function(*args, **kwargs))

    def __repr__(self) -> str:
        return f"<cached {self.name!r} {len(self.cache)}/{self.cache.max_entries}>"
