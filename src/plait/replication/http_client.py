"""The internal HTTP API's client (`InternalClient`); its rules (R-RP-6, R-RP-7) are in
`http_api`."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
from yarl import URL

from plait.core import strict_json
from plait.core.backoff import Backoff
from plait.errors import ConfigError, RemoteCallError
from plait.replication.http_api import (
    MAX_PAGE_LIMIT,
    PREFIX,
    TXN_ID,
    AwaitPositions,
    CatchUpPage,
    OwnPositions,
    check_endpoint_name,
    check_secret,
    is_int,
    json_body,
    positions_or_none,
)

logger = logging.getLogger(__name__)
_TRANSIENT_STATUSES = frozenset({502, 503, 504})


def _check_txn_id(txn_id: object) -> str:
    if not isinstance(txn_id, str) or not TXN_ID.fullmatch(txn_id):
        raise ConfigError(
            f"txn_id {txn_id!r} is invalid: use 1-128 letters, digits, '_', '-' and '.'"
        )
    return txn_id


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
        self._secret = check_secret(secret)
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
            if not is_int(value):
                raise ConfigError(f"catch_up: {what} must be an integer, not {value!r}")
        if not is_int(limit) or not 1 <= limit <= MAX_PAGE_LIMIT:
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
                if not is_int(token):
                    raise TypeError("a token is not an integer")
                rows.append((token, row))
            upto, limited, reset = payload["upto"], payload["limited"], payload["reset"]
            if not (is_int(upto) and isinstance(limited, bool) and isinstance(reset, bool)):
                raise TypeError("upto/limited/reset have the wrong types")
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteCallError(f"{what}: malformed answer ({exc})", status=200) from None
        return CatchUpPage(rows=rows, upto=upto, limited=limited, reset=reset)

    async def call(self, instance: str, name: str, args: Any, *, txn_id: str | None = None) -> Any:
        """Run endpoint `name` on `instance` with JSON `args` and return its JSON result.

        The callee runs it after it has seen this instance's positions; this returns
        after this instance has seen the callee's. Retried with the same txn_id, so the
        endpoint runs at most once (pass your own txn_id to extend that across calls)."""
        check_endpoint_name(name)
        txn_id = uuid.uuid4().hex if txn_id is None else _check_txn_id(txn_id)
        base = self._base_url(instance)
        url = URL(f"{base}{PREFIX}/call/{name}/{txn_id}", encoded=True)
        try:
            body = json_body(
                {"caller": self.instance_name, "positions": self._own_positions(), "args": args}
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"call {name!r}: args are not JSON-serialisable: {exc}") from exc
        what = f"call {name!r} on instance {instance!r} (txn {txn_id})"
        payload = await self._request("POST", url, body, what)
        positions = positions_or_none(payload.get("positions"))
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
