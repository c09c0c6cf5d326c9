"""The internal HTTP API (R-RP-6, R-RP-7), over real sockets on 127.0.0.1: bearer auth,
catch-up pages, calls that run once however often they are retried, retries of what
may pass, positions in both directions, and errors that never take the server down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import pace
from http_api_helpers import (
    SECRET,
    Counter,
    MakeClient,
    MemoryStream,
    StartApi,
    already_seen,
    no_streams,
    raw_request,
)
from pace import scaled
from plait.errors import ConfigError, RemoteCallError
from plait.ports import free_port
from plait.replication.http_api import CatchUpPage
from plait.replication.http_server import InternalApi
from plait.replication.metrics import ReplicationMetrics

pytestmark = pytest.mark.timeout(30)


def _body(args: Any = None, caller: str = "client", positions: dict[str, int] | None = None) -> Any:
    return {"caller": caller, "positions": positions or {}, "args": args}


# -- 1. auth ---------------------------------------------------------------------------


async def test_without_a_secret_calls_need_no_header(
    start_api: StartApi, make_client: MakeClient, http: aiohttp.ClientSession
) -> None:
    api = await start_api()
    api.register("echo", Counter())
    client = make_client({"server": api.url})
    assert await client.call("server", "echo", [1, "two"]) == {"echo": [1, "two"], "run": 1}
    async with http.post(f"{api.url}/_plait/v1/call/echo/t1", json=_body("x")) as resp:
        assert resp.status == 200
        assert (await resp.json())["result"]["echo"] == "x"


async def test_with_a_secret_only_the_right_bearer_header_passes(
    start_api: StartApi, http: aiohttp.ClientSession
) -> None:
    api = await start_api(secret=SECRET)
    handler = Counter()
    api.register("echo", handler)
    url = f"{api.url}/_plait/v1/call/echo/txn"
    wrong_headers: list[dict[str, str]] = [
        {},
        {"Authorization": "Bearer not-the-secret"},
        {"Authorization": f"Bearer {SECRET}x"},
        {"Authorization": f"Basic {SECRET}"},
        {"Authorization": SECRET},
        {"Authorization": "Bearer "},
        {"Authorization": "Bearer \xff\xfe\xe9"},  # latin-1 bytes, not UTF-8
    ]
    for headers in wrong_headers:
        async with http.post(url, json=_body(), headers=headers) as resp:
            assert resp.status == 401, headers
            assert "secret" in (await resp.json())["error"]
    # Bytes no client library would send: UTF-8, invalid UTF-8, nothing after the scheme.
    for value in ("Bearer é€😀".encode(), b"Bearer \xff\xfe\x80\xc3", b"\xc3\x28"):
        status, body = await raw_request(
            api.port,
            b"GET /_plait/v1/streams/s/updates?from=0&to=1&limit=1 HTTP/1.1\r\n"
            b"Host: x\r\nAuthorization: " + value + b"\r\nConnection: close\r\n\r\n",
        )
        assert status == 401, (value, body)
        assert b'"error"' in body
    # Paths no route serves need the secret too: nothing about the server leaks out.
    async with http.get(f"{api.url}/_plait/v1/nothing-here") as resp:
        assert resp.status == 401
    assert handler.runs == 0

    good = {"Authorization": f"Bearer {SECRET}"}
    async with http.post(url, json=_body(7), headers=good) as resp:
        assert resp.status == 200
        assert (await resp.json())["result"] == {"echo": 7, "run": 1}
    async with http.post(url, json=_body(7), headers={"authorization": f"bearer {SECRET}"}) as r:
        assert r.status == 200  # the scheme is case-insensitive (RFC 7235)


async def test_a_client_with_another_secret_is_told_the_secrets_differ(
    start_api: StartApi, make_client: MakeClient
) -> None:
    api = await start_api(secret=SECRET)
    handler = Counter()
    api.register("echo", handler)
    for secret in ("other-secret", None):
        client = make_client({"server": api.url}, secret=secret)
        with pytest.raises(RemoteCallError, match="secrets differ"):
            await client.call("server", "echo", 1)
        with pytest.raises(RemoteCallError, match="secrets differ"):
            await client.catch_up("server", "s", 0, 10, 10)
    assert handler.runs == 0
    right = make_client({"server": api.url}, secret=SECRET)
    assert await right.call("server", "echo", 1) == {"echo": 1, "run": 1}


async def test_metrics_need_no_secret_and_show_what_was_counted(
    start_api: StartApi, http: aiohttp.ClientSession
) -> None:
    metrics = ReplicationMetrics()
    metrics.catch_up_pages.labels("events").inc(3)
    api = await start_api(secret=SECRET, metrics=metrics)
    async with http.get(f"{api.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
    assert 'plait_catch_up_pages_total{stream="events"} 3.0' in text

    bare = await start_api()  # no metrics given: no route
    async with http.get(f"{bare.url}/metrics") as resp:
        assert resp.status == 404
        assert "error" in await resp.json()


def test_secrets_that_cannot_travel_in_a_header_are_refused() -> None:
    for secret in ("", "two words", "naïve", "line\nbreak"):
        with pytest.raises(ConfigError, match="secret"):
            InternalApi(
                instance_name="a",
                secret=secret,
                catch_up=no_streams,
                own_positions=dict,
                await_positions=already_seen,
            )


# -- 2. catch-up -----------------------------------------------------------------------


async def test_catch_up_pages_come_back_whole(start_api: StartApi, make_client: MakeClient) -> None:
    rows = {t: {"id": t, "text": f"row {t}", "tags": ["a", None]} for t in range(1, 8)}
    source = MemoryStream("odd/stream name?é", rows)
    api = await start_api(catch_up=source)
    client = make_client({"server": api.url})

    pages: list[CatchUpPage] = []
    upto = 0
    while True:
        page = await client.catch_up("server", source.name, upto, 10, 3)
        pages.append(page)
        upto = page.upto
        if not page.limited:
            break
    assert [p.limited for p in pages] == [True, True, False]
    assert [p.upto for p in pages] == [3, 6, 10]
    assert [row for p in pages for row in p.rows] == sorted(rows.items())
    assert all(isinstance(token, int) for p in pages for token, _ in p.rows)
    assert not any(p.reset for p in pages)
    assert source.asked[0] == (source.name, 0, 10, 3)  # the odd name arrived intact

    empty = await client.catch_up("server", source.name, 10, 10, 5)
    assert empty == CatchUpPage(rows=[], upto=10, limited=False, reset=False)

    source.lost_upto = 5  # the writer restarted: what it has is all there is
    page = await client.catch_up("server", source.name, 2, 10, 100)
    assert page.reset
    assert page.rows == sorted(rows.items())


async def test_catch_up_of_a_stream_not_served_is_a_404(
    start_api: StartApi, make_client: MakeClient, http: aiohttp.ClientSession
) -> None:
    api = await start_api(catch_up=MemoryStream("events", {1: "x"}))
    client = make_client({"server": api.url})
    with pytest.raises(RemoteCallError, match=r"404.*'others'"):
        await client.catch_up("server", "others", 0, 5, 10)
    async with http.get(f"{api.url}/_plait/v1/streams/others/updates?from=0&to=5&limit=1") as r:
        assert r.status == 404
        assert "does not serve stream 'others'" in (await r.json())["error"]


@pytest.mark.parametrize(
    ("query", "complaint"),
    [
        ("to=5&limit=10", "'from' is missing"),
        ("from=0&limit=10", "'to' is missing"),
        ("from=0&to=5", "'limit' is missing"),
        ("from=abc&to=5&limit=10", "'from' must be an integer"),
        ("from=1.5&to=5&limit=10", "'from' must be an integer"),
        ("from=0&to=&limit=10", "'to' must be an integer"),
        ("from=0&to=5&limit=1e3", "'limit' must be an integer"),
        ("from=0&to=99999999999999999999999&limit=10", "'to' must be an integer"),
        ("from=0&to=5&limit=0", "limit must be between 1 and 10000"),
        ("from=0&to=5&limit=10001", "limit must be between 1 and 10000"),
        ("from=0&to=5&limit=-3", "limit must be between 1 and 10000"),
        ("from=6&to=5&limit=10", "to (5) is below from (6)"),
    ],
)
async def test_catch_up_with_bad_query_values_is_a_400_saying_what_is_wrong(
    start_api: StartApi, http: aiohttp.ClientSession, query: str, complaint: str
) -> None:
    source = MemoryStream("events", {1: "x"})
    api = await start_api(catch_up=source)
    async with http.get(f"{api.url}/_plait/v1/streams/events/updates?{query}") as resp:
        assert resp.status == 400
        assert complaint in (await resp.json())["error"]
    assert source.asked == []


async def test_the_client_checks_its_arguments_before_sending(make_client: MakeClient) -> None:
    client = make_client({"server": "http://127.0.0.1:1"})
    with pytest.raises(ConfigError, match=r"'elsewhere'.*instance_map"):
        await client.catch_up("elsewhere", "events", 0, 5, 10)
    with pytest.raises(ConfigError, match=r"'elsewhere'.*instance_map"):
        await client.call("elsewhere", "echo", None)
    with pytest.raises(ConfigError, match="limit"):
        await client.catch_up("server", "events", 0, 5, 0)
    with pytest.raises(ConfigError, match="txn_id"):
        await client.call("server", "echo", None, txn_id="has space")
    with pytest.raises(ConfigError, match="endpoint name"):
        await client.call("server", "no/slash", None)
    with pytest.raises(ConfigError, match="JSON"):
        await client.call("server", "echo", {"not": object()})
    with pytest.raises(ConfigError, match="base URL"):
        make_client({"server": "127.0.0.1:8080"})


# -- call routes: validation -----------------------------------------------------------


async def test_endpoint_names_are_checked_and_registered_once(start_api: StartApi) -> None:
    api = await start_api()
    api.register("do_it-2", Counter())
    with pytest.raises(ConfigError, match="already registered"):
        api.register("do_it-2", Counter())
    for bad in ("", "a b", "a/b", "a.b", "é"):
        with pytest.raises(ConfigError, match="letters, digits"):
            api.register(bad, Counter())


@pytest.mark.parametrize(
    ("path", "body", "status", "complaint"),
    [
        ("/call/echo/" + "t" * 129, _body(), 400, "txn_id"),
        ("/call/echo/t%20x", _body(), 400, "txn_id"),
        ("/call/echo/t:x", _body(), 400, "txn_id"),
        ("/call/nope/t1", _body(), 404, "no endpoint 'nope'"),
        ("/call/echo/t1", b"{not json", 400, "not valid JSON"),
        ("/call/echo/t1", b"\xff\xfe", 400, "not valid JSON"),
        ("/call/echo/t1", b"[1, 2]", 400, "JSON object"),
        ("/call/echo/t1", {"positions": {}, "args": 1}, 400, "'caller'"),
        ("/call/echo/t1", {"caller": "", "positions": {}, "args": 1}, 400, "'caller'"),
        ("/call/echo/t1", {"caller": "c", "positions": [], "args": 1}, 400, "'positions'"),
        ("/call/echo/t1", {"caller": "c", "positions": {"s": "1"}, "args": 1}, 400, "'positions'"),
        ("/call/echo/t1", {"caller": "c", "positions": {"s": True}, "args": 1}, 400, "'positions'"),
        ("/call/echo/t1", {"caller": "c", "positions": {}}, 400, "'args'"),
    ],
)
async def test_malformed_calls_are_refused_with_a_reason(
    start_api: StartApi,
    http: aiohttp.ClientSession,
    path: str,
    body: Any,
    status: int,
    complaint: str,
) -> None:
    api = await start_api()
    handler = Counter()
    api.register("echo", handler)
    kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(f"{api.url}/_plait/v1{path}", **kwargs) as resp:
        assert resp.status == status
        assert complaint in (await resp.json())["error"]
    assert handler.runs == 0
    async with http.get(f"{api.url}/_plait/v1/call/echo/t1") as resp:
        assert resp.status == 405  # wrong method: still a JSON error
        assert "error" in await resp.json()


# -- 3. idempotent retries -------------------------------------------------------------


async def test_a_repeated_txn_id_runs_the_handler_once(
    start_api: StartApi, make_client: MakeClient
) -> None:
    api = await start_api()
    handler = Counter()
    api.register("count", handler)
    client = make_client({"server": api.url})
    first = await client.call("server", "count", "a", txn_id="txn-1")
    again = await client.call("server", "count", "ignored: the answer is cached", txn_id="txn-1")
    assert first == again == {"echo": "a", "run": 1}
    assert handler.runs == 1
    assert await client.call("server", "count", "b") == {"echo": "b", "run": 2}  # fresh txn
    assert await client.call("server", "count", "c") == {"echo": "c", "run": 3}


async def test_concurrent_calls_with_one_txn_id_share_one_run(
    start_api: StartApi, make_client: MakeClient
) -> None:
    api = await start_api()
    handler = Counter(hold=True)
    api.register("count", handler)
    client = make_client({"server": api.url})
    calls = [
        asyncio.create_task(client.call("server", "count", i, txn_id="same")) for i in range(5)
    ]
    try:
        async with pace.within(5, "five calls with one txn_id to share one run"):
            await handler.started.wait()
            # The other four reach the server while the first still runs.
            await pace.until(
                lambda: len(api._runner.server.connections) >= 5,  # type: ignore[union-attr]
                10,
                "five connections at the server",
            )
            await asyncio.sleep(0.05)  # and are read (each waits on the first run)
            runs_while_held = handler.runs
            handler.gate.set()
            results = await asyncio.gather(*calls)
    finally:
        handler.gate.set()
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    assert runs_while_held == 1
    assert handler.runs == 1
    assert all(r == results[0] for r in results)


async def test_the_same_txn_id_from_another_caller_is_another_call(
    start_api: StartApi, make_client: MakeClient
) -> None:
    api = await start_api()
    handler = Counter()
    api.register("count", handler)
    one = make_client({"server": api.url}, instance_name="one")
    two = make_client({"server": api.url}, instance_name="two")
    assert await one.call("server", "count", 1, txn_id="t") == {"echo": 1, "run": 1}
    assert await two.call("server", "count", 2, txn_id="t") == {"echo": 2, "run": 2}
    assert await one.call("server", "count", 3, txn_id="t") == {"echo": 1, "run": 1}
    assert handler.runs == 2


async def test_cached_answers_expire_and_are_bounded(
    start_api: StartApi, make_client: MakeClient
) -> None:
    ttl = scaled(0.2)  # the calls below must come within it, on a busy machine too
    api = await start_api(response_ttl=ttl, max_cached_responses=2)
    handler = Counter()
    api.register("count", handler)
    client = make_client({"server": api.url})
    await client.call("server", "count", "a", txn_id="a")
    await client.call("server", "count", "b", txn_id="b")
    await client.call("server", "count", "c", txn_id="c")  # "a", the oldest, goes
    assert handler.runs == 3
    assert (await client.call("server", "count", "c", txn_id="c"))["run"] == 3  # cached
    assert (await client.call("server", "count", "a", txn_id="a"))["run"] == 4  # evicted
    await asyncio.sleep(ttl * 1.5)
    assert (await client.call("server", "count", "c", txn_id="c"))["run"] == 5  # expired


class LosingProxy:
    """A TCP proxy in front of a server that loses the first answer: once the server
    has answered (so the handler ran), it closes the client's connection instead of
    passing the answer on, as a network failure at the worst moment would."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.answers_to_lose = 1
        self.connections = 0
        self.request_lines: list[bytes] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> LosingProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def forward_requests() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await client_r.read(65536):
                    self.request_lines += re.findall(rb"POST \S+ HTTP/1\.1", data)
                    up_w.write(data)
                    await up_w.drain()

        pump = asyncio.create_task(forward_requests())
        self._tasks.add(pump)
        pump.add_done_callback(self._tasks.discard)
        try:
            while data := await up_r.read(65536):
                if self.answers_to_lose > 0:
                    self.answers_to_lose -= 1
                    break  # the answer is lost on the way back
                client_w.write(data)
                await client_w.drain()
        except ConnectionError:
            pass
        finally:
            pump.cancel()
            for writer in (client_w, up_w):
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()


async def test_a_lost_answer_is_retried_with_the_same_txn_id_and_runs_once(
    start_api: StartApi, make_client: MakeClient
) -> None:
    api = await start_api()
    transfer = Counter()
    api.register("transfer", transfer)
    async with LosingProxy(api.port) as proxy:
        client = make_client({"server": f"http://127.0.0.1:{proxy.port}"})
        async with pace.within(5, "the transfer call, its first answer lost"):
            result = await client.call("server", "transfer", {"amount": 5})
    assert result == {"echo": {"amount": 5}, "run": 1}
    assert transfer.runs == 1
    assert proxy.answers_to_lose == 0  # the first answer really was lost
    assert proxy.connections == 2  # ...and the client came back on a new connection
    # Both attempts named the same call: the second found the first's answer.
    assert len(proxy.request_lines) == 2
    assert proxy.request_lines[0] == proxy.request_lines[1]
    assert proxy.request_lines[0].startswith(b"POST /_plait/v1/call/transfer/")


async def test_a_retry_after_a_timeout_waits_for_the_run_in_progress(
    start_api: StartApi, make_client: MakeClient
) -> None:
    api = await start_api()
    slow = Counter(delay=0.5)
    api.register("slow", slow)
    client = make_client({"server": api.url}, request_timeout=0.2, retry_for=3.0)
    async with pace.within(5, "the slow call, retried after its request timed out"):
        assert await client.call("server", "slow", None) == {"echo": None, "run": 1}
    assert slow.runs == 1


# -- 4. retries of transient failures ----------------------------------------------------


async def test_the_client_retries_until_the_server_listens(
    start_api: StartApi, make_client: MakeClient
) -> None:
    port = free_port()
    client = make_client({"server": f"http://127.0.0.1:{port}"}, retry_for=5.0)
    handler = Counter()
    async with pace.within(5, "the calls made before the server listened"):
        call = asyncio.create_task(client.call("server", "echo", "hi"))
        page = asyncio.create_task(client.catch_up("server", "events", 0, 5, 10))
        await asyncio.sleep(0.3)
        assert not call.done()
        api = await start_api(port=port, catch_up=MemoryStream("events", {2: "r"}))
        api.register("echo", handler)
        assert await call == {"echo": "hi", "run": 1}
        assert (await page).rows == [(2, "r")]


async def test_the_client_gives_up_after_retry_for(make_client: MakeClient) -> None:
    client = make_client({"server": f"http://127.0.0.1:{free_port()}"}, retry_for=0.3)
    started = time.monotonic()
    with pytest.raises(RemoteCallError, match=r"gave up after \d+ attempts"):
        await client.call("server", "echo", None)
    assert 0.3 <= time.monotonic() - started < 2.0
    with pytest.raises(RemoteCallError, match="gave up"):
        await client.catch_up("server", "events", 0, 1, 1)


async def test_gateway_errors_are_retried_and_client_errors_are_not(
    make_client: MakeClient,
) -> None:
    # A stand-in server (not an InternalApi): a proxy that says 503 twice, then answers;
    # and a route that always says 400.
    hits = {"flaky": 0, "bad": 0}

    async def flaky(request: web.Request) -> web.Response:
        hits["flaky"] += 1
        if hits["flaky"] <= 2:
            return web.json_response({"error": "warming up"}, status=503)
        return web.json_response({"result": "ok", "positions": {}})

    async def bad(request: web.Request) -> web.Response:
        hits["bad"] += 1
        return web.json_response({"error": "that makes no sense"}, status=400)

    app = web.Application()
    app.router.add_post("/_plait/v1/call/flaky/{txn}", flaky)
    app.router.add_post("/_plait/v1/call/bad/{txn}", bad)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        client = make_client({"server": f"http://127.0.0.1:{site.port}"})
        assert await client.call("server", "flaky", None) == "ok"
        assert hits["flaky"] == 3
        with pytest.raises(RemoteCallError, match="HTTP 400: that makes no sense"):
            await client.call("server", "bad", None)
        assert hits["bad"] == 1
    finally:
        await runner.cleanup()


# -- 5. positions ----------------------------------------------------------------------


async def test_positions_travel_both_ways_and_are_awaited(
    start_api: StartApi, make_client: MakeClient
) -> None:
    server_waited: list[tuple[str, dict[str, int]]] = []
    client_waited: list[tuple[str, dict[str, int]]] = []

    async def server_await(instance: str, positions: dict[str, int]) -> None:
        await asyncio.sleep(0.05)  # the handler must not start before this returns
        server_waited.append((instance, positions))

    async def client_await(instance: str, positions: dict[str, int]) -> None:
        await asyncio.sleep(0.05)
        client_waited.append((instance, positions))

    server_positions = {"events": 10}
    api = await start_api(
        instance_name="worker",
        own_positions=lambda: dict(server_positions),
        await_positions=server_await,
    )

    async def write(args: Any) -> Any:
        seen_before_running = list(server_waited)
        server_positions["events"] = 12  # the handler wrote two rows
        return seen_before_running

    api.register("write", write)
    client = make_client(
        {"worker": api.url},
        instance_name="main",
        own_positions=lambda: {"events": 7, "receipts": 3},
        await_positions=client_await,
    )
    result = await client.call("worker", "write", None)
    assert result == [["main", {"events": 7, "receipts": 3}]]
    assert client_waited == [("worker", {"events": 12})]  # after the handler's writes


async def test_a_failed_wait_for_the_callers_positions_is_retried(
    start_api: StartApi, make_client: MakeClient
) -> None:
    """The handler did not run, so the answer (503) is retried with the same txn id,
    and the handler then runs exactly once."""
    failures = [RuntimeError("positions not reachable")]

    async def flaky_await(instance: str, positions: dict[str, int]) -> None:
        if failures:
            raise failures.pop()

    api = await start_api(await_positions=flaky_await)
    handler = Counter()
    api.register("count", handler)
    client = make_client({"server": api.url})
    assert await client.call("server", "count", "x") == {"echo": "x", "run": 1}
    assert failures == []
    assert handler.runs == 1


# -- 6. handler errors, and stopping ----------------------------------------------------


async def test_a_failing_handler_gives_a_500_once_and_the_server_keeps_serving(
    start_api: StartApi,
    make_client: MakeClient,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = await start_api()
    runs = 0

    async def broken(args: Any) -> Any:
        nonlocal runs
        runs += 1
        raise ValueError(f"boom {args}")

    api.register("broken", broken)
    api.register("echo", Counter())
    client = make_client({"server": api.url})
    with (
        caplog.at_level(logging.ERROR, logger="plait.replication.http_server"),
        pytest.raises(RemoteCallError, match=r"HTTP 500: ValueError: boom 1"),
    ):
        await client.call("server", "broken", 1, txn_id="b1")
    assert runs == 1
    assert any(r.exc_info and "broken" in r.getMessage() for r in caplog.records)
    # A retry gets the same error from the cache; it does not run the handler again.
    with pytest.raises(RemoteCallError, match="boom 1"):
        await client.call("server", "broken", 2, txn_id="b1")
    assert runs == 1

    async def unserialisable(args: Any) -> Any:
        return {"set": {1, 2}}

    api.register("unserialisable", unserialisable)
    with pytest.raises(RemoteCallError, match=r"HTTP 500: TypeError"):
        await client.call("server", "unserialisable", None)

    async def failing_source(stream: str, a: int, b: int, c: int) -> CatchUpPage:
        raise RuntimeError("disk on fire")

    api._catch_up = failing_source
    async with http.get(f"{api.url}/_plait/v1/streams/s/updates?from=0&to=1&limit=1") as r:
        assert r.status == 500
        assert (await r.json())["error"] == "RuntimeError: disk on fire"
    assert await client.call("server", "echo", "still here") == {"echo": "still here", "run": 1}


async def test_stop_ends_calls_in_progress_and_closes_the_port(
    start_api: StartApi, http: aiohttp.ClientSession
) -> None:
    api = await start_api(shutdown_timeout=0.1)
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def forever(args: Any) -> Any:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    api.register("forever", forever)
    port = api.port
    request = asyncio.create_task(http.post(f"{api.url}/_plait/v1/call/forever/t", json=_body()))
    try:
        async with pace.within(3, "the call to start, then stop() to end it"):
            await started.wait()
            await api.stop()
        assert cancelled.is_set()  # stop() returned only after the run ended
    finally:
        with contextlib.suppress(aiohttp.ClientError):
            (await request).release()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    assert api._calls == {}
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("plait-call-")]
    await api.stop()  # twice is fine


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "example.org", "10.1.2.3"])
async def test_no_secret_means_no_listening_beyond_this_machine(
    start_api: StartApi, host: str
) -> None:
    with pytest.raises(ConfigError, match="without a secret"):
        await start_api(host=host)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
async def test_loopback_needs_no_secret(
    start_api: StartApi, make_client: MakeClient, host: str
) -> None:
    api = await start_api(host=host)
    api.register("echo", Counter())
    client = make_client({"server": api.url})  # [::1] for ::1: api.url brackets it
    assert await client.call("server", "echo", host) == {"echo": host, "run": 1}


async def test_with_a_secret_any_address_will_do(
    start_api: StartApi, make_client: MakeClient
) -> None:
    api = await start_api(host="0.0.0.0", secret=SECRET)
    api.register("echo", Counter())
    here = f"http://127.0.0.1:{api.port}"  # 0.0.0.0 listens on every address
    client = make_client({"server": here}, secret=SECRET)
    assert await client.call("server", "echo", 1) == {"echo": 1, "run": 1}
    stranger = make_client({"server": here}, secret=None)
    with pytest.raises(RemoteCallError) as refused:
        await stranger.call("server", "echo", 2)
    assert refused.value.status == 401
