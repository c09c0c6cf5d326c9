"""The Redis pub/sub transport (R-RP-1): every instance of a deployment on one channel.

Rules:
- Each connection is two Redis connections: one subscribed to the channel, one that
  publishes. `Handler.open` is called only once SUBSCRIBE is confirmed, so the answers
  to the REPLICATE it sends at once cannot be missed.
- `Link.send` never blocks: lines wait in the connection's own queue, which one task
  publishes in order, a pipeline per round trip. Lines queued together travel in one
  message, separated by newlines (a command line never holds one), up to
  `_MESSAGE_BYTES`: a burst of 100 invalidations or rows is a few messages for Redis and
  for every subscriber to handle, not 100. Lines sent while no connection is open,
  or for a connection that has ended, are dropped (peers catch up after reconnecting);
  they never leak into the next connection.
- Every message on the channel reaches the session, our own echoes included (the handler
  drops those), except PINGs. A PING goes out every `ping_interval` and comes back
  through the subscription: 3 x `ping_interval` without one of our own back means a
  dead path, even while other instances' messages still arrive (our publisher may be
  the broken half).
- Any failure ends the connection: `Session.closed()`, both Redis connections closed, a
  backoff delay, a new attempt, forever. The backoff starts over only once the session
  says every stream caught up (`Session.wait_up`, R-RP-3), so a connection that fails
  while catching up never reconnects in a tight loop.
- Every task belongs to the transport; `stop()` ends them all. A connection's end does
  not rest on its tasks honouring cancellation (redis-py on Python 3.11 can swallow
  one): its queue and session are closed first, then its sockets (`_ended`).
- With a secret (`replication.secret`), every message is signed and every message
  received is verified (`plait.core.signed_messages`: one HMAC per message, the
  sender's name inside it, runs and seqs against replays). A refused message or line
  is counted (`plait_refused_lines_total`, by reason) and warned about at most once per
  `_WARN_INTERVAL` per reason, never once per line. A message missing from a run ends
  the connection: the session starts over and catches up. Without a secret, lines
  travel unsigned (logged once at start), and only a Redis on this machine is allowed.
- TLS (rediss:// URLs) and a password given apart from the URL are checked when the
  transport is built (`client_options`): a missing certificate file or a TLS option on a
  plain URL is a `ConfigError` before anything connects, not a reconnect loop. Neither
  the password nor a URL holding one is ever logged (`plait.core.redact`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from plait.core.backoff import Backoff
from plait.core.commands import CONNECTION_COMMANDS, command_name
from plait.core.redact import redact
from plait.core.signed_messages import (
    FOREIGN,
    SIGNED_WITHOUT_SECRET,
    Accepted,
    Signer,
    Verifier,
    foreign,
    key_of,
    looks_signed,
)
from plait.errors import ConfigError
from plait.replication.link import Handler, Session, wait_set
from plait.replication.metrics import ReplicationMetrics
from plait.replication.redis_connection import LABEL, Liveness, Refusals, SendQueue, packed
from plait.replication.redis_options import RedisOptions, check_signing
from plait.tasks import cancel_and_wait, to_the_end

logger = logging.getLogger(__name__)

# Silence (nothing received, not even our own PING) longer than this many ping
# intervals means the path is dead.
_SILENT_PINGS = 3
# How long stop() waits for queued lines to be published.
_FLUSH_PATIENCE = 1.0
# How long closing the Redis connections may take (a dead peer must not hold stop() up).
_CLOSE_PATIENCE = 1.0
# The receiver lets the other tasks run after this many messages read back to back (a
# read from a full buffer does not yield to the event loop).
_YIELD_EVERY = 100
# The longest name in CONNECTION_COMMANDS fits in this many bytes of a message.
_NAME_BYTES = 16
# Failures that are the network's or the server's, logged without a traceback. Anything
# else is a bug somewhere and is logged with one; both end the connection alike.
_EXPECTED_FAILURES = (RedisError, OSError, TimeoutError)


class RedisTransport:
    """Keeps one pub/sub connection to `channel` open for `handler`, reconnecting with
    `backoff` forever, from `start()` until `stop()`. `tls` applies to rediss:// URLs;
    `password`, when given, must not be in the URL too (see `client_options`).
    `secret`: the deployment's replication secret, which signs every message sent and
    must verify every message received (`max_clock_skew`: seconds a message's stamp may
    differ from this machine's clock, checked for the first of each sender's connection);
    without one, the URL must be a loopback or unix:// one."""

    def __init__(
        self,
        handler: Handler,
        options: RedisOptions,
        *,
        channel: str,
        secret: str | None = None,
        backoff: Backoff | None = None,
        metrics: ReplicationMetrics | None = None,
    ) -> None:
        # ConfigError (a ValueError) when the URL, TLS settings or password are wrong,
        # or when a Redis off this machine would carry unsigned lines.
        self._client_options = options.client_options()
        check_signing(options.url, secret)
        if not channel:
            raise ConfigError("redis transport: the channel name is empty")
        self._key = None if secret is None else key_of(secret)
        self._verifier = (
            None
            if self._key is None
            else Verifier(self._key, channel, max_skew_ms=int(options.max_clock_skew * 1000))
        )
        self._handler = handler
        self._url = options.url
        self._channel = channel
        self._ping_interval = options.ping_interval
        self._connect_timeout = options.connect_timeout
        self._backoff = Backoff() if backoff is None else backoff
        metrics = ReplicationMetrics() if metrics is None else metrics
        self._refusals = Refusals(metrics, channel)
        self._up_gauge = metrics.connection_up.labels(link=LABEL)
        self._reconnects = metrics.reconnects.labels(link=LABEL)
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._queue: SendQueue | None = None  # the open connection's
        self._open = asyncio.Event()  # set while a session is open
        self._failures = 0  # failed attempts since the connection was last up

    @property
    def label(self) -> str:
        return LABEL

    async def start(self) -> None:
        """Start connecting in the background; returns at once."""
        if self._started:
            raise RuntimeError("redis transport: start() may be called only once")
        self._started = True
        self._up_gauge.set(0)
        if self._key is None:
            # Not a warning: without a secret only a Redis on this machine is allowed.
            logger.info(
                "redis transport: lines on %s are not signed (no replication.secret): any "
                "client of this Redis that may PUBLISH there can inject rows and positions; "
                "set replication.secret, the same on every instance",
                self._channel,
            )
        self._task = asyncio.create_task(self._run(), name=f"redis transport {self._channel}")

    async def stop(self) -> None:
        """Publish what is queued (for at most about a second), then end every task and
        close both connections. Nothing of the transport runs after this returns."""
        self._started = True  # no start() after stop()
        task, self._task = self._task, None
        if task is None:
            return
        queue = self._queue
        if queue is not None:
            try:
                async with asyncio.timeout(_FLUSH_PATIENCE):
                    await queue.drained()
            except TimeoutError:
                logger.warning("redis transport: stopping with unpublished lines")
        # redis-py can swallow a cancellation that arrives while it connects, and the
        # task would then run on into the connection's task group.
        await cancel_and_wait(task)
        self._up_gauge.set(0)

    async def wait_open(self, timeout: float) -> bool:  # noqa: ASYNC109 (False on timeout)
        """Whether a connection is open (its session opened) within `timeout` seconds."""
        return await wait_set(self._open, timeout)

    # -- the run loop ------------------------------------------------------------------

    async def _run(self) -> None:
        attempts = 0
        while True:
            if attempts:  # every attempt but the first follows a failure
                self._reconnects.inc()
            attempts += 1
            try:
                await self._connection()
            except Exception as err:  # stop() cancels; anything else ends the connection
                self._log_failure(err)
            else:  # not expected (the connection's tasks run until they fail)
                self._log_failure(ConnectionError("the connection ended"))
            await asyncio.sleep(self._backoff.next_delay())

    async def _connection(self) -> None:
        """One connection, from connecting to its failure, which it raises."""
        subscriber = self._client()
        publisher = self._client()
        pubsub = subscriber.pubsub()
        queue: SendQueue | None = None
        session: Session | None = None
        tasks: list[asyncio.Task[None]] = []
        try:
            try:
                async with asyncio.timeout(self._connect_timeout):
                    # Auth and reachability, before anything opens. Not PONG: no Redis
                    # server (e.g. a connection to its own port, made while the server
                    # was down, hands every command back as its answer).
                    if not await publisher.ping():
                        raise ConnectionError(
                            "the server did not answer PING with PONG: not a Redis server"
                        )
                    await pubsub.subscribe(self._channel)
                    await _confirmed(pubsub)
            except TimeoutError as err:
                raise TimeoutError(
                    f"no answer within {self._connect_timeout:g} s to connecting and SUBSCRIBE"
                ) from err
            except _EXPECTED_FAILURES:
                raise
            except Exception as err:
                # A peer that is not Redis (a port reused by another program, one
                # that hands every command back) can trip redis-py's own reply
                # handling: redis-py 8 reads an echoed HELLO as a map and raises
                # AttributeError. What failed is the peer, not plait.
                raise ConnectionError(
                    f"the server's answers to connecting are not Redis's "
                    f"({type(err).__name__}: {err}): not a Redis server"
                ) from err
            queue = SendQueue()
            signer = None
            if self._key is not None:
                # A new run per connection: its seqs start over, and receivers know
                # nothing of it was sent before (see plait.core.signed_messages).
                run = secrets.token_hex(8)
                signer = Signer(self._key, self._channel, self._handler.instance_name, run)
            if self._verifier is not None:
                self._verifier.new_session()
            # Signed: every line is a proven sender's, in its own name (FENCED aside,
            # which receivers check against the database).
            session = self._handler.open(
                queue, reply_errors=False, authenticated=self._verifier is not None
            )
            self._queue = queue
            self._open.set()
            logger.debug("redis transport: subscribed to %s", self._channel)
            liveness = Liveness(asyncio.get_running_loop().time())
            tasks = [
                asyncio.create_task(self._publish(publisher, queue, signer)),
                asyncio.create_task(self._receive(pubsub, session, liveness)),
                asyncio.create_task(self._keep_alive(queue, liveness)),
                asyncio.create_task(self._mark_up(session)),
                asyncio.create_task(queue.until_closed()),
            ]
            await _first_failure(tasks)
        finally:
            self._open.clear()
            self._up_gauge.set(0)
            if queue is not None:
                queue.close()
                if self._queue is queue:
                    self._queue = None
            if session is not None:
                _closed(session)
            closers = (pubsub.aclose, subscriber.aclose, publisher.aclose)
            # A connection closed half-way is leaked; stop() cancels every 0.1 s.
            _, cancelled = await to_the_end(_ended(tasks, closers))
            if cancelled:
                raise asyncio.CancelledError

    def _client(self) -> Redis:
        # No retries inside redis-py (it would reconnect, and resubscribe, behind our
        # back): every failure reaches the run loop, which closes the session.
        # No socket_timeout (redis-py's default is 5 s): with one, redis-py sends every
        # command through asyncio.wait_for, which on Python 3.11 swallows a cancellation
        # that arrives as the send completes (CPython gh-86296; 324 of 400 cancelled
        # PUBLISHes here). A server that stops answering is found by the keep-alive.
        return Redis.from_url(
            self._url,
            socket_timeout=None,
            socket_connect_timeout=self._connect_timeout,
            retry=Retry(NoBackoff(), 0, supported_errors=()),
            **self._client_options,
        )

    # -- the tasks of one connection ---------------------------------------------------

    async def _publish(self, publisher: Redis, queue: SendQueue, signer: Signer | None) -> None:
        channel = self._channel
        while True:
            messages = packed(await queue.take())
            if signer is not None:
                now_ms = int(time.time() * 1000)
                messages = [signer.sign(message, now_ms) for message in messages]
            if len(messages) == 1:  # the common case after a write: no pipeline to build
                await publisher.publish(channel, messages[0])
            elif messages:
                async with publisher.pipeline(transaction=False) as pipe:
                    for message in messages:
                        pipe.publish(channel, message)
                    await pipe.execute()
            queue.published()

    async def _receive(self, pubsub: PubSub, session: Session, liveness: Liveness) -> None:
        loop = asyncio.get_running_loop()
        count = 0
        while True:
            message = await pubsub.get_message(timeout=None)  # None: wait for one
            count += 1
            if count % _YIELD_EVERY == 0:
                await asyncio.sleep(0)
            if message is None or message["type"] != "message":
                continue
            data: bytes = message["data"]
            sender = None
            if self._verifier is not None:
                verdict = self._verifier.check(data, int(time.time() * 1000))
                if not isinstance(verdict, Accepted):
                    # Lines after the header, once it verified; else every line.
                    refused = data.count(b"\n") + (0 if verdict.sender is not None else 1)
                    self._refusals.refuse(verdict.reason, refused, verdict.sender, verdict.detail)
                    if verdict.restart:
                        who = (verdict.sender or b"?").decode(errors="replace")
                        raise ConnectionError(
                            f"a message of {who} is missing ({verdict.detail}): starting "
                            "over to catch up"
                        )
                    continue
                sender = verdict.sender
            elif looks_signed(data):
                self._refusals.refuse(SIGNED_WITHOUT_SECRET, data.count(b"\n"), None)
                continue
            lines = data.split(b"\n")
            for line in lines if sender is None else lines[1:]:  # [1:]: not the header
                name = command_name(line[:_NAME_BYTES].decode(errors="replace"))
                if name in CONNECTION_COMMANDS:  # PING: liveness only
                    liveness.heard(line, loop.time())
                    continue
                if sender is not None and foreign(line, sender):
                    self._refusals.refuse(FOREIGN, 1, sender, line[:80].decode(errors="replace"))
                    continue
                try:
                    session.received(line)
                except Exception:  # the session promises not to raise: a bug
                    logger.exception("redis transport: the session failed on a %s line", name)

    async def _keep_alive(self, queue: SendQueue, liveness: Liveness) -> None:
        loop = asyncio.get_running_loop()
        silence = _SILENT_PINGS * self._ping_interval
        next_ping = loop.time() + self._ping_interval
        while True:
            now = loop.time()
            if now - liveness.last_echo >= silence:
                raise TimeoutError(f"none of our PINGs came back for {silence:g} s")
            if now >= next_ping:
                queue.send(liveness.ping(int(time.time() * 1000)))
                next_ping = now + self._ping_interval
            await asyncio.sleep(min(next_ping, liveness.last_echo + silence) - now)

    async def _mark_up(self, session: Session) -> None:
        await session.wait_up()
        self._backoff.up()
        self._up_gauge.set(1)
        if self._failures:
            logger.info(
                "redis transport: up again on %s after %d failed attempt(s)",
                redact(self._url),
                self._failures,
            )
        self._failures = 0

    def _log_failure(self, err: Exception) -> None:
        self._failures += 1
        expected = isinstance(err, _EXPECTED_FAILURES)
        if self._failures == 1:
            log = logger.warning if expected else logger.error
        else:
            log = logger.debug
        log(
            "redis transport: %s (channel %s): %s: %s%s; reconnecting with backoff "
            "(failure %d in a row)",
            redact(self._url),
            self._channel,
            type(err).__name__,
            err,
            _tls_hint(err),
            self._failures,
            exc_info=None if expected else err,
        )


# -- helpers -----------------------------------------------------------------------------


async def _confirmed(pubsub: PubSub) -> None:
    """Returns once the server confirmed the subscription."""
    while True:
        message = await pubsub.get_message(timeout=None)
        if message is not None and message["type"] == "subscribe":
            return


async def _first_failure(tasks: list[asyncio.Task[None]]) -> None:
    """Wait until one of the connection's tasks fails (all but `_mark_up` run until
    one does), and raise its failure."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:  # in their order, so that one failure is picked alike
            if task not in done:
                continue
            if task.cancelled():
                raise ConnectionError(f"a task of the connection was cancelled: {task!r}")
            failure = task.exception()
            if failure is not None:
                raise failure
    raise ConnectionError("the connection ended")


async def _ended(
    tasks: list[asyncio.Task[None]], closers: tuple[Callable[[], Awaitable[None]], ...]
) -> None:
    """End the connection's tasks and close its Redis connections.

    Not a TaskGroup: it waits for a cancelled task however long it takes, and a task
    that swallows its cancellation (redis-py on Python 3.11 did, see `_client`) held
    the connection forever: its receiver gone, its publisher still publishing, nothing
    logged. Here the sockets are closed after the cancellation, which ends whatever
    still waits on them, a task is cancelled again until it ends, and one that will
    not end is left behind, logged: its queue and its session are closed already."""
    for task in tasks:
        task.cancel()
    await _close_all(closers)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _CLOSE_PATIENCE
    pending = {task for task in tasks if not task.done()}
    while pending and loop.time() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.05)
    for task in tasks:
        if task in pending:
            logger.error("redis transport: a task of a closed connection did not end: %r", task)
        elif not task.cancelled():
            task.exception()  # retrieved: the first failure was raised already


def _closed(session: Session) -> None:
    try:
        session.closed()
    except Exception:  # the next connection must still come
        logger.exception("redis transport: Session.closed() failed")


async def _close_all(closers: tuple[Callable[[], Awaitable[None]], ...]) -> None:
    """Close each in turn, for at most `_CLOSE_PATIENCE` in all; never raises."""
    try:
        async with asyncio.timeout(_CLOSE_PATIENCE):
            for close in closers:
                try:
                    await close()
                except Exception as err:
                    logger.debug("redis transport: closing a connection: %s", err)
    except TimeoutError:
        logger.debug("redis transport: closing the connections timed out")


def _tls_hint(err: BaseException) -> str:
    """What to check when `err` came from verifying the server's certificate."""
    seen: BaseException | None = err
    for _ in range(5):  # redis-py wraps the SSL error once or twice
        if seen is None:
            break
        if isinstance(seen, ssl.SSLCertVerificationError):
            return (
                " (the server's TLS certificate was refused: check that ssl_ca_certs names "
                "the CA that signed it and that the URL's host is a name in it)"
            )
        seen = seen.__cause__ or seen.__context__
    return ""
