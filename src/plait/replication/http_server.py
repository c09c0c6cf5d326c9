"""The internal HTTP API's server (`InternalApi`); its rules (R-RP-6, R-RP-7) are in
`http_api`."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from plait.core import strict_json
from plait.errors import ConfigError
from plait.ports import is_loopback
from plait.replication.http_api import (
    INTEGER,
    MAX_PAGE_LIMIT,
    PREFIX,
    TXN_ID,
    AwaitPositions,
    CatchUpSource,
    EndpointHandler,
    OwnPositions,
    check_endpoint_name,
    check_secret,
    is_int,
    json_body,
    positions_or_none,
)
from plait.replication.metrics import ReplicationMetrics

logger = logging.getLogger(__name__)
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=json_body(payload), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json_response({"error": message}, status)


# --------------------------------------------------------------------------------------
# Server


@dataclass(slots=True)
class _Outcome:
    """A finished call's answer, as sent (and resent to retries)."""

    status: int
    body: bytes


@dataclass(slots=True)
class _CachedCall:
    run: asyncio.Task[_Outcome]
    expires_at: float | None = None  # set when the run finished


class InternalApi:
    """The HTTP server of one instance: catch-up for its in-memory streams, its
    registered endpoints and `/metrics`.

    Guarantees: a call (caller, name, txn_id) runs its handler at most once per
    `response_ttl` seconds, however often it is retried; the handler runs only after
    `await_positions` returned for the caller's positions; `stop()` leaves nothing running.
    """

    def __init__(
        self,
        *,
        instance_name: str,
        secret: str | None,
        catch_up: CatchUpSource,
        own_positions: OwnPositions,
        await_positions: AwaitPositions,
        metrics: ReplicationMetrics | None = None,
        response_ttl: float = 1800.0,
        max_cached_responses: int = 10_000,
        shutdown_timeout: float = 5.0,
    ) -> None:
        if not isinstance(instance_name, str) or not instance_name:
            raise ConfigError("InternalApi: instance_name must be a non-empty string")
        if not response_ttl > 0:
            raise ConfigError(f"InternalApi: response_ttl must be positive, not {response_ttl!r}")
        if not is_int(max_cached_responses) or max_cached_responses < 1:
            raise ConfigError(
                "InternalApi: max_cached_responses must be a positive integer, "
                f"not {max_cached_responses!r}"
            )
        if not shutdown_timeout >= 0:
            raise ConfigError(
                f"InternalApi: shutdown_timeout must be >= 0, not {shutdown_timeout!r}"
            )
        self.instance_name = instance_name
        self._secret = check_secret(secret)
        self._catch_up = catch_up
        self._own_positions = own_positions
        self._await_positions = await_positions
        self._metrics = metrics
        self._response_ttl = response_ttl
        self._max_cached = max_cached_responses
        self._shutdown_timeout = shutdown_timeout
        self._handlers: dict[str, EndpointHandler] = {}
        self._calls: OrderedDict[tuple[str, str, str], _CachedCall] = OrderedDict()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._host = ""

    def register(self, name: str, handler: EndpointHandler) -> None:
        """Serve `handler` at `POST /_plait/v1/call/<name>/<txn_id>`; may be done before
        or after `start()`."""
        check_endpoint_name(name)
        if name in self._handlers:
            raise ConfigError(f"endpoint {name!r} is already registered")
        self._handlers[name] = handler

    @property
    def port(self) -> int:
        """The port the server listens on (the real one when started with port 0)."""
        if self._site is None:
            raise RuntimeError("InternalApi is not started")
        return self._site.port

    @property
    def url(self) -> str:
        """The base URL other instances put in their instance_map."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Listen on (host, port); returns once connections are accepted. Without a
        secret only a loopback address is allowed: the API hands out stream rows and
        runs endpoints for whoever reaches it."""
        if self._runner is not None:
            raise RuntimeError("InternalApi is already started")
        if self._secret is None and not is_loopback(host):
            raise ConfigError(
                f"the internal HTTP API would listen on {host!r} without a secret, so "
                "anyone who reaches it could read streams and call endpoints: set "
                "http.secret (every instance then sends it), or listen on 127.0.0.1"
            )
        middlewares = [self._errors_middleware]
        if self._secret is not None:
            middlewares.append(self._auth_middleware)
        app = web.Application(middlewares=middlewares)
        app.router.add_get(PREFIX + "/streams/{stream}/updates", self._handle_updates)
        app.router.add_post(PREFIX + "/call/{name}/{txn_id}", self._handle_call)
        if self._metrics is not None:
            app.router.add_get("/metrics", self._handle_metrics)
        runner = web.AppRunner(app, shutdown_timeout=self._shutdown_timeout)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self._site, self._host = runner, site, host

    async def stop(self) -> None:
        """Stop listening, let requests in progress finish (up to `shutdown_timeout`),
        then cancel any call still running. Safe to call twice."""
        runner, self._runner, self._site = self._runner, None, None
        try:
            if runner is not None:
                await runner.cleanup()
        finally:
            runs = [entry.run for entry in self._calls.values() if not entry.run.done()]
            for run in runs:
                run.cancel()
            if runs:
                await asyncio.gather(*runs, return_exceptions=True)
            self._calls.clear()

    # -- middlewares ---------------------------------------------------------------

    @web.middleware
    async def _errors_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Turns every failure into a JSON error answer; nothing escapes to aiohttp."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = _error(
                exc.status, f"{exc.text or exc.reason} ({request.method} {request.path})"
            )
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("internal API: %s %s failed", request.method, request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")

    @web.middleware
    async def _auth_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        # Everything but /metrics needs the secret (not just paths that look like
        # /_plait/: no spelling of a path can slip past).
        open_route = request.match_info.handler == self._handle_metrics
        if not open_route and not self._authorized(request):
            response = _error(401, "missing or wrong bearer secret for the internal API")
            response.headers["WWW-Authenticate"] = 'Bearer realm="plait"'
            return response
        return await handler(request)

    def _authorized(self, request: web.Request) -> bool:
        # Raw header bytes: whatever a client sends (non-ASCII, odd encodings) is just
        # bytes that do not match, never a decoding error.
        assert self._secret is not None
        values = [v for k, v in request.raw_headers if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(b" ")
        # Compare even on a wrong scheme so the time taken does not say which part failed.
        token_ok = hmac.compare_digest(token.strip(), self._secret)
        return token_ok and scheme.lower() == b"bearer"

    # -- routes ----------------------------------------------------------------------

    async def _handle_updates(self, request: web.Request) -> web.Response:
        stream = request.match_info["stream"]
        bounds: dict[str, int] = {}
        for key in ("from", "to", "limit"):
            text = request.query.get(key)
            if text is None:
                return _error(400, f"query parameter {key!r} is missing")
            if not INTEGER.fullmatch(text):
                return _error(400, f"query parameter {key!r} must be an integer, not {text!r}")
            bounds[key] = int(text)
        if not 1 <= bounds["limit"] <= MAX_PAGE_LIMIT:
            return _error(
                400, f"limit must be between 1 and {MAX_PAGE_LIMIT}, not {bounds['limit']}"
            )
        if bounds["to"] < bounds["from"]:
            return _error(400, f"to ({bounds['to']}) is below from ({bounds['from']})")
        try:
            page = await self._catch_up(stream, bounds["from"], bounds["to"], bounds["limit"])
        except KeyError:
            return _error(404, f"instance {self.instance_name!r} does not serve stream {stream!r}")
        return _json_response(
            {
                "rows": page.rows,  # (token, row) pairs: JSON arrays as they are
                "upto": page.upto,
                "limited": page.limited,
                "reset": page.reset,
            }
        )

    async def _handle_call(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        txn_id = request.match_info["txn_id"]
        if not TXN_ID.fullmatch(txn_id):
            return _error(400, "txn_id must be 1-128 letters, digits, '_', '-' or '.'")
        handler = self._handlers.get(name)
        if handler is None:
            return _error(404, f"instance {self.instance_name!r} has no endpoint {name!r}")
        try:
            body = strict_json.loads(await request.read())
        except ValueError as exc:  # UnicodeDecodeError included
            return _error(400, f"the request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        caller = body.get("caller")
        positions = positions_or_none(body.get("positions"))
        if not isinstance(caller, str) or not caller:
            return _error(400, "'caller' must be a non-empty string (the calling instance)")
        if positions is None:
            return _error(400, "'positions' must be an object of stream name -> integer")
        if "args" not in body:
            return _error(400, "'args' is missing")

        key = (caller, name, txn_id)
        entry = self._calls.get(key)
        now = time.monotonic()
        if entry is not None and entry.expires_at is not None and entry.expires_at <= now:
            del self._calls[key]
            entry = None
        if entry is None:
            run = asyncio.create_task(
                self._run_call(key, handler, positions, body["args"]),
                name=f"plait-call-{name}-{txn_id}",
            )
            entry = _CachedCall(run)
            self._calls[key] = entry
            run.add_done_callback(lambda _: self._finished(key, entry))
            self._evict(now)
        # The run is a task of its own: a caller that hangs up does not cancel it, and a
        # retry waits for the same run. asyncio.wait neither raises nor cancels the run.
        await asyncio.wait([entry.run])
        if entry.run.cancelled():
            return _error(503, f"instance {self.instance_name!r} is stopping")
        outcome = entry.run.result()
        return web.Response(
            body=outcome.body, status=outcome.status, content_type="application/json"
        )

    async def _run_call(
        self,
        key: tuple[str, str, str],
        handler: EndpointHandler,
        positions: dict[str, int],
        args: Any,
    ) -> _Outcome:
        caller, name, txn_id = key
        try:
            await self._await_positions(caller, positions)
        except Exception as exc:
            logger.exception(
                "internal API: waiting for %s's positions %s failed", caller, positions
            )
            # The handler did not run, so a retry may safely try again: forget this one,
            # and answer 503, which the client retries.
            self._calls.pop(key, None)
            return _Outcome(503, json_body({"error": f"{type(exc).__name__}: {exc}"}))
        try:
            result = await handler(args)
            body = json_body({"result": result, "positions": self._own_positions()})
        except Exception as exc:
            logger.exception(
                "internal API: endpoint %r failed (caller %r, txn %r)", name, caller, txn_id
            )
            return _Outcome(500, json_body({"error": f"{type(exc).__name__}: {exc}"}))
        return _Outcome(200, body)

    def _finished(self, key: tuple[str, str, str], entry: _CachedCall) -> None:
        if entry.run.cancelled():
            if self._calls.get(key) is entry:
                del self._calls[key]
            return
        entry.expires_at = time.monotonic() + self._response_ttl

    def _evict(self, now: float) -> None:
        """Drops expired answers, then the oldest finished ones beyond the bound. Calls
        still running are never dropped: that would let a retry run them twice."""
        # Oldest first, stopping early: calls finish roughly in the order they came, so
        # the expired ones sit at the front.
        while self._calls:
            key, entry = next(iter(self._calls.items()))
            if entry.expires_at is None or entry.expires_at > now:
                break
            del self._calls[key]
        excess = len(self._calls) - self._max_cached
        if excess > 0:
            done = (key for key, entry in self._calls.items() if entry.run.done())
            for key in list(itertools.islice(done, excess)):
                del self._calls[key]

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        assert self._metrics is not None
        return web.Response(
            body=self._metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )
