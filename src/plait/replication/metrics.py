"""Prometheus metrics of one instance (R-OP-2), in a registry of its own so that several
instances in one process (tests, the demo) never clash.

Counters are bumped where things happen; positions are read from the streams at scrape
time by a collector, so the write path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Read back by `plait status` from every instance's /metrics.
OLDEST_UNFINISHED_AGE = "plait_stream_oldest_unfinished_age_seconds"


@dataclass(frozen=True, slots=True)
class StreamSnapshot:
    """What the collector reports of one stream at scrape time."""

    stream: str
    positions: dict[str, int]  # writer -> position
    persisted_upto: int
    queue_length: int
    # When this instance writes the stream: its name, and seconds its oldest pending
    # ID has waited (0 when none is pending).
    own_writer: str | None = None
    oldest_unfinished_age: float = 0.0


class _StreamCollector(Collector):
    def __init__(self, snapshots: Callable[[], Iterable[StreamSnapshot]]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        position = GaugeMetricFamily(
            "plait_stream_position",
            "A writer's position as this instance sees it.",
            labels=["stream", "writer"],
        )
        persisted = GaugeMetricFamily(
            "plait_stream_persisted_upto",
            "The stream's linear position (persisted-up-to).",
            labels=["stream"],
        )
        gap = GaugeMetricFamily(
            "plait_stream_position_gap",
            "Largest minus smallest writer position: how far a slow writer holds readers back.",
            labels=["stream"],
        )
        queue = GaugeMetricFamily(
            "plait_inbound_queue_length",
            "Replication commands waiting, per stream.",
            labels=["stream"],
        )
        oldest = GaugeMetricFamily(
            OLDEST_UNFINISHED_AGE,
            "How long this writer's lowest unfinished ID (or a fetch of IDs in flight) has "
            "been pending: what holds its position back; 0 when nothing is pending.",
            labels=["stream", "writer"],
        )
        for snap in self._snapshots():
            for writer, value in snap.positions.items():
                position.add_metric([snap.stream, writer], value)
            persisted.add_metric([snap.stream], snap.persisted_upto)
            values = list(snap.positions.values())
            gap.add_metric([snap.stream], max(values) - min(values) if values else 0)
            queue.add_metric([snap.stream], snap.queue_length)
            if snap.own_writer is not None:
                oldest.add_metric([snap.stream, snap.own_writer], snap.oldest_unfinished_age)
        yield from (position, persisted, gap, queue, oldest)


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """What the collector reports of one cache at scrape time."""

    cache: str
    size: int
    max_entries: int
    hits: int
    misses: int
    evictions: int


class _CacheCollector(Collector):
    def __init__(self, snapshots: Callable[[], Iterable[CacheSnapshot]]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        labels = ["cache"]
        size = GaugeMetricFamily("plait_cache_size", "Entries in the cache.", labels=labels)
        limit = GaugeMetricFamily(
            "plait_cache_max_entries", "The cache's entry limit.", labels=labels
        )
        hits = CounterMetricFamily(
            "plait_cache_hits", "Lookups answered from the cache.", labels=labels
        )
        misses = CounterMetricFamily(
            "plait_cache_misses", "Lookups that had to load the value.", labels=labels
        )
        evictions = CounterMetricFamily(
            "plait_cache_evictions", "Entries dropped to stay within the limit.", labels=labels
        )
        for snap in self._snapshots():
            size.add_metric([snap.cache], snap.size)
            limit.add_metric([snap.cache], snap.max_entries)
            hits.add_metric([snap.cache], snap.hits)
            misses.add_metric([snap.cache], snap.misses)
            evictions.add_metric([snap.cache], snap.evictions)
        yield from (size, limit, hits, misses, evictions)


class ReplicationMetrics:
    """The metrics of one instance."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, str], Any] = {}
        r = self.registry
        self.commands_in = Counter(
            "plait_commands_received", "Replication commands received.", ["command"], registry=r
        )
        self.commands_out = Counter(
            "plait_commands_sent", "Replication commands sent.", ["command"], registry=r
        )
        self.bad_lines = Counter(
            "plait_bad_command_lines", "Malformed command lines received.", ["link"], registry=r
        )
        self.refused_positions = Counter(
            "plait_refused_positions",
            "Positions and rows refused because they claim an ID above the stream's "
            "sequence head (a forged or corrupted line: see the log).",
            ["stream"],
            registry=r,
        )
        self.refused_lines = Counter(
            "plait_refused_lines",
            "Command lines received and dropped unread, by reason: unsigned or wrongly "
            "signed messages, replays, lines speaking for another instance than their sender.",
            ["link", "reason"],
            registry=r,
        )
        self.rdata_rows = Counter(
            "plait_rdata_rows", "Rows received live (RDATA) and delivered.", ["stream"], registry=r
        )
        self.rows_read_back = Counter(
            "plait_rows_read_back",
            "Own rows read back from the database to send them (their statements did not "
            "return whole rows: RETURNING * sends them from memory).",
            ["stream"],
            registry=r,
        )
        self.inbound_overflows = Counter(
            "plait_inbound_overflows",
            "Times a stream's inbound queue on a connection passed replication.inbound_queue "
            "commands (its listeners slower than its writers): the queued commands were "
            "dropped and the stream caught up from the database (or its writers) instead.",
            ["stream"],
            registry=r,
        )
        self.catch_up_rows = Counter(
            "plait_catch_up_rows", "Rows read while catching up.", ["stream"], registry=r
        )
        self.catch_up_pages = Counter(
            "plait_catch_up_pages", "Pages read while catching up.", ["stream"], registry=r
        )
        self.wait_timeouts = Counter(
            "plait_wait_timeouts",
            "wait_for_stream_position calls that timed out.",
            ["stream"],
            registry=r,
        )
        self.connection_up = Gauge(
            "plait_connection_up",
            "1 while a replication connection is up (every stream caught up), else 0.",
            ["link"],
            registry=r,
        )
        self.hub_buffered_bytes = Gauge(
            "plait_tcp_hub_buffered_bytes",
            "Bytes the TCP hub holds for its peers: lines queued, written but not sent, "
            "received but not read (a slow or hostile peer shows here first).",
            registry=r,
        )
        self.tcp_hub_refused = Counter(
            "plait_tcp_hub_refused",
            "What the TCP hub refused, by reason: connections (busy: no handshake slot for "
            "their address; handshake: no or a malformed handshake; auth: no or a wrong "
            "proof of replication.secret; name: the hub's own) and lines (impersonation: "
            "rows or positions not in the sender's name; bad: any other bad line).",
            ["reason"],
            registry=r,
        )
        self.reconnects = Counter(
            "plait_reconnects",
            "Replication connection attempts after a failure.",
            ["link"],
            registry=r,
        )

        self.invalidations_sent = Counter(
            "plait_cache_invalidations_sent",
            "Invalidation rows this instance committed, by cache (or pseudo-cache) name.",
            ["cache"],
            registry=r,
        )
        self.invalidations_applied = Counter(
            "plait_cache_invalidations_applied",
            "Invalidations applied to a cache here (local and remote, pseudo-caches "
            "expanded), by cache name.",
            ["cache"],
            registry=r,
        )
        self.invalidations_ignored = Counter(
            "plait_cache_invalidations_ignored",
            "Invalidations received for a cache this instance does not have.",
            ["cache"],
            registry=r,
        )

        self.invalidation_rows_deleted = Counter(
            "plait_cache_invalidation_rows_deleted",
            "Old invalidation rows deleted by this instance's cleanup job.",
            registry=r,
        )

    def child(self, counter: Counter, label: str) -> Any:
        """`counter.labels(label)`, cached: the hot path counts every command, and a
        labels() lookup takes a lock and builds a key each time."""
        key = (id(counter), label)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = counter.labels(label)
        return found

    def watch_streams(self, snapshots: Callable[[], Iterable[StreamSnapshot]]) -> None:
        """Report positions and queue lengths read from `snapshots` at scrape time."""
        self.registry.register(_StreamCollector(snapshots))

    def watch_caches(self, snapshots: Callable[[], Iterable[CacheSnapshot]]) -> None:
        """Report cache sizes, hits and misses read from `snapshots` at scrape time."""
        self.registry.register(_CacheCollector(snapshots))

    def render(self) -> bytes:
        """The text exposition format, for the `/metrics` endpoint."""
        return generate_latest(self.registry)
