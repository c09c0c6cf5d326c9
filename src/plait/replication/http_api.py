"""The internal HTTP API between plait instances (R-RP-6, R-RP-7): server and client.

Rules:
- Two kinds of route, both under `/_plait/v1/`: catch-up of an in-memory stream (the rows
  live only in their writer's memory, so a reader that missed some asks the writer) and
  application calls registered by name.
- A call carries the caller's own stream positions and the answer carries the callee's;
  the callee waits for the caller's before running the handler, the caller waits for the
  callee's before `call` returns. So each side sees the other's writes (read-your-writes).
- A call is named by (caller, name, txn_id). The client keeps one txn_id across its
  retries and the server caches the answer (errors included), so a retried call runs its
  handler at most once, even when the retry arrives while the first run is still going.
- With a secret, every `/_plait/` route needs `Authorization: Bearer <secret>`, compared
  in constant time; a missing or wrong one is a 401, never a 500. `/metrics` is open.
- Every error body is JSON `{"error": "..."}`; no request can crash the server.
- The client retries what may pass (refused or dropped connections, timeouts, 502/503/504)
  with capped exponential backoff for `retry_for` seconds; anything else fails at once
  with a `RemoteCallError` carrying the server's error text.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web
from yarl import URL

from plait.core import strict_json
from plait.core.backoff import Backoff
from plait.errors import ConfigError, RemoteCallError
from plait.ports import is_loopback
from plait.replication import defaults
from plait.replication.metrics import ReplicationMetrics
from plait.streams.memory import ReadPage

logger = logging.getLogger(__name__)


# One page of an in-memory stream's rows, as its writer holds them (one type for the
# page whether it is read locally or over HTTP).
CatchUpPage = ReadPage

# (stream, from_exclusive, to_inclusive, limit); raises KeyError for a stream it does not serve.
CatchUpSource = Callable[[str, int, int, int], Awaitable[CatchUpPage]]
# JSON args -> JSON result.
EndpointHandler = Callable[[Any], Awaitable[Any]]
# stream -> this instance's own writer position, piggybacked on calls and answers.
OwnPositions = Callable[[], dict[str, int]]
# (other instance, {stream: position}): returns once this instance has seen them. The
# implementation bounds its own wait (R-RP-6: on timeout it logs and returns).
AwaitPositions = Callable[[str, dict[str, int]], Awaitable[None]]

PREFIX = "/_plait/v1"
MAX_PAGE_LIMIT = defaults.MAX_PAGE_LIMIT
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_ENDPOINT_NAME = re.compile(r"[A-Za-z0-9_-]+")
_TXN_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]{0,18})")
# What a secret may hold: it travels in an HTTP header, so visible ASCII only.
_SECRET = re.compile(r"[!-~]+")
_TRANSIENT_STATUSES = frozenset({502, 503, 504})


def _check_secret(secret: str | None) -> bytes | None:
    if secret is None:
        return None
    if not isinstance(secret, str) or not _SECRET.fullmatch(secret):
        raise ConfigError(
            "the internal API secret must be a non-empty string of visible ASCII characters "
            "(no spaces); use None to turn authentication off"
        )
    return secret.encode("ascii")


def _check_endpoint_name(name: object) -> str:
    if not isinstance(name, str) or not _ENDPOINT_NAME.fullmatch(name):
        raise ConfigError(
            f"endpoint name {name!r} is invalid: use letters, digits, '_' and '-' only"
        )
    return name


def _check_txn_id(txn_id: object) -> str:
    if not isinstance(txn_id, str) or not _TXN_ID.fullmatch(txn_id):
        raise ConfigError(
            f"txn_id {txn_id!r} is invalid: use 1-128 letters, digits, '_', '-' and '.'"
        )
    return txn_id


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positions_or_none(value: object) -> dict[str, int] | None:
    """`value` as a {stream: position} map, or None when it is not one."""
    if not isinstance(value, dict):
        return None
    if not all(isinstance(k, str) and _is_int(v) for k, v in value.items()):
        return None
    return dict(value)


def _json_body(payload: object) -> bytes:
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()


def _json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=_json_body(payload), status=status, content_type="application/json")


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
        if not _is_int(max_cached_responses) or max_cached_responses < 1:
            raise ConfigError(
                "InternalApi: max_cached_responses must be a positive integer, "
                f"not {max_cached_responses!r}"
            )
        if not shutdown_timeout >= 0:
            raise ConfigError(
                f"InternalApi: shutdown_timeout must be >= 0, not {shutdown_timeout!r}"
            )
        self.instance_name = instance_name
        self._secret = _check_secret(secret)
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
        _check_endpoint_name(name)
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
            if not _INTEGER.fullmatch(text):
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
        if not _TXN_ID.fullmatch(txn_id):
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
        positions = _positions_or_none(body.get("positions"))
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
            return _Outcome(503, _json_body({"error": f"{type(exc).__name__}: {exc}"}))
        try:
            result = await handler(args)
            body = _json_body({"result": result, "positions": self._own_positions()})
        except Exception as exc:
            logger.exception(
                "internal API: endpoint %r failed (caller %r, txn %r)", name, caller, txn_id
            )
            return _Outcome(500, _json_body({"error": f"{type(exc).__name__}: {exc}"}))
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


# --------------------------------------------------------------------------------------
# Client


class _Transient(Exception):
    """An attempt failed in a way a retry may fix; `status` of its answer, if any."""

    def __init__(self, text: str, status: int | None = None) -> None:
        super().__init__(text)
        self.status = status


class InternalClient:
    """Calls other instances' internal APIs, retrying transient failures.

    Guarantees: `call` sends one txn_id on every retry of one call (so the callee runs
    it at most once) and returns only after this instance has seen the callee's positions
    from the answer. Failures are `RemoteCallError`s saying what the other side said.
    """

    def __init__(
        self,
        *,
        instance_name: str,
        instance_map: Mapping[str, str],
        secret: str | None,
        own_positions: OwnPositions,
        await_positions: AwaitPositions,
        request_timeout: float = 30.0,
        retry_for: float = 60.0,
    ) -> None:
        if not isinstance(instance_name, str) or not instance_name:
            raise ConfigError("InternalClient: instance_name must be a non-empty string")
        if not request_timeout > 0:
            raise ConfigError(
                f"InternalClient: request_timeout must be positive, not {request_timeout!r}"
            )
        if not retry_for >= 0:
            raise ConfigError(f"InternalClient: retry_for must be >= 0, not {retry_for!r}")
        self.instance_name = instance_name
        self._urls: dict[str, URL] = {}
        for name, base in instance_map.items():
            url = URL(base) if isinstance(base, str) else None
            if url is None or url.scheme not in ("http", "https") or not url.host:
                raise ConfigError(
                    f"instance_map[{name!r}] must be a base URL like http://host:port, not {base!r}"
                )
            self._urls[name] = url.with_path(url.path.rstrip("/"))
        self._secret = _check_secret(secret)
        self._own_positions = own_positions
        self._await_positions = await_positions
        self._request_timeout = request_timeout
        self._retry_for = retry_for
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    async def catch_up(
        self, instance: str, stream: str, from_exclusive: int, to_inclusive: int, limit: int
    ) -> CatchUpPage:
        """One page of `stream` as held in `instance`'s memory: rows with tokens in
        (from_exclusive, to_inclusive], at most `limit` of them."""
        for what, value in (("from_exclusive", from_exclusive), ("to_inclusive", to_inclusive)):
            if not _is_int(value):
                raise ConfigError(f"catch_up: {what} must be an integer, not {value!r}")
        if not _is_int(limit) or not 1 <= limit <= MAX_PAGE_LIMIT:
            raise ConfigError(f"catch_up: limit must be in 1..{MAX_PAGE_LIMIT}, not {limit!r}")
        if not isinstance(stream, str) or not stream:
            raise ConfigError(f"catch_up: stream must be a non-empty string, not {stream!r}")
        base = self._base_url(instance)
        path = f"{PREFIX}/streams/{quote(stream, safe='')}/updates"
        url = URL(str(base) + path, encoded=True).with_query(
            {"from": from_exclusive, "to": to_inclusive, "limit": limit}
        )
        what = f"catch-up of stream {stream!r} from instance {instance!r}"
        payload = await self._request("GET", url, None, what)
        try:
            rows_json = payload["rows"]
            rows: list[tuple[int, Any]] = []
            for item in rows_json:
                token, row = item
                if not _is_int(token):
                    raise TypeError("a token is not an integer")
                rows.append((token, row))
            upto, limited, reset = payload["upto"], payload["limited"], payload["reset"]
            if not (_is_int(upto) and isinstance(limited, bool) and isinstance(reset, bool)):
                raise TypeError("upto/limited/reset have the wrong types")
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteCallError(f"{what}: malformed answer ({exc})", status=200) from None
        return CatchUpPage(rows=rows, upto=upto, limited=limited, reset=reset)

    async def call(self, instance: str, name: str, args: Any, *, txn_id: str | None = None) -> Any:
        """Run endpoint `name` on `instance` with JSON `args` and return its JSON result.

        The callee runs it after it has seen this instance's positions; this returns
        after this instance has seen the callee's. Retried with the same txn_id, so the
        endpoint runs at most once (pass your own txn_id to extend that across calls)."""
        _check_endpoint_name(name)
        txn_id = uuid.uuid4().hex if txn_id is None else _check_txn_id(txn_id)
        base = self._base_url(instance)
        url = URL(f"{base}{PREFIX}/call/{name}/{txn_id}", encoded=True)
        try:
            body = _json_body(
                {"caller": self.instance_name, "positions": self._own_positions(), "args": args}
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"call {name!r}: args are not JSON-serialisable: {exc}") from exc
        what = f"call {name!r} on instance {instance!r} (txn {txn_id})"
        payload = await self._request("POST", url, body, what)
        positions = _positions_or_none(payload.get("positions"))
        if "result" not in payload or positions is None:
            raise RemoteCallError(f"{what}: malformed answer (no result or positions)", status=200)
        await self._await_positions(instance, positions)
        return payload["result"]

    async def close(self) -> None:
        """Close the HTTP session; the client cannot be used afterwards."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    # -- internals -------------------------------------------------------------------

    def _base_url(self, instance: str) -> URL:
        url = self._urls.get(instance)
        if url is None:
            raise ConfigError(
                f"unknown instance {instance!r}: add it to instance_map (known: "
                f"{sorted(self._urls) or 'none'})"
            )
        return url

    def _get_session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RemoteCallError("InternalClient is closed")
        if self._session is None:
            headers = {}
            if self._secret is not None:
                headers["Authorization"] = "Bearer " + self._secret.decode("ascii")
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self._request_timeout),
            )
        return self._session

    async def _request(
        self, method: str, url: URL, body: bytes | None, what: str
    ) -> dict[str, Any]:
        """The JSON object of a 200 answer, retrying transient failures for `retry_for`."""
        deadline = time.monotonic() + self._retry_for
        backoff = Backoff(initial=0.05, cap=2.0)
        attempts = 0
        while True:
            attempts += 1
            try:
                return await self._attempt(method, url, body, what)
            except _Transient as exc:
                delay = backoff.next_delay()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RemoteCallError(
                        f"{what}: gave up after {attempts} attempts in "
                        f"{self._retry_for:g} s: {exc}",
                        status=exc.status,
                    ) from None
                logger.debug("%s: attempt %d failed (%s); retrying", what, attempts, exc)
                await asyncio.sleep(min(delay, remaining))

    async def _attempt(
        self, method: str, url: URL, body: bytes | None, what: str
    ) -> dict[str, Any]:
        session = self._get_session()
        headers = {"Content-Type": "application/json"} if body is not None else None
        try:
            async with session.request(method, url, data=body, headers=headers) as response:
                status = response.status
                raw = await response.read()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise _Transient(text) from exc
        if status in _TRANSIENT_STATUSES:
            raise _Transient(f"HTTP {status}: {_error_text(raw)}", status)
        if status == 200:
            try:
                payload = strict_json.loads(raw)
            except ValueError as exc:
                raise RemoteCallError(
                    f"{what}: the answer is not JSON: {exc}", status=status
                ) from None
            if not isinstance(payload, dict):
                raise RemoteCallError(f"{what}: the answer is not a JSON object", status=status)
            return payload
        raise _failure(status, raw, what)


def _failure(status: int, raw: bytes, what: str) -> RemoteCallError:
    """The error for an answer that no retry can fix (4xx, 500, ...)."""
    text = _error_text(raw)
    if status == 401:
        return RemoteCallError(
            f"{what}: HTTP 401, the instances' internal API secrets differ "
            f"(or only one side has one): {text}",
            status=status,
        )
    return RemoteCallError(f"{what}: HTTP {status}: {text}", status=status)


def _error_text(raw: bytes) -> str:
    """The server's error message: the `error` of a JSON body, else the body's start."""
    try:
        payload = strict_json.loads(raw)
    except ValueError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), str):
        return str(payload["error"])
    text = raw[:300].decode("utf-8", "replace").strip()
    return text or "(no body)"
