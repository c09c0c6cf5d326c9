"""Where every stream and writer stands (`plait status`): from the database, plus what
the instances' `/metrics` say when their addresses are known.

`assess` is pure (what one query returned in, verdicts out), so the rules are tested
without a server; `read` is that query. A stream is *stalled* when the writer holding
its persisted-up-to position has not moved its row for `stall_after` seconds while
another writer is ahead: every linear reader then waits on that writer. An idle live
writer is never stalled: it moves its row up to the others' positions every second.

Only a writer itself knows how long its oldest unfinished ID has waited (the database
has no record of IDs taken and not yet committed), so that age comes from its
`plait_stream_oldest_unfinished_age_seconds` gauge: `scrape` reads it.
"""

from __future__ import annotations

import http.client
import json
import math
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

from plait.replication.metrics import OLDEST_UNFINISHED_AGE
from plait.storage.stream_records import RecordedStream

DEFAULT_STALL_AFTER = 30.0
# Largest /metrics answer read from an instance; a real one is a few hundred kilobytes.
MAX_METRICS_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class WriterStatus:
    writer: str
    position: int | None  # None: configured, no row yet (never wrote)
    age: float | None
    behind: int  # how far below the stream's furthest writer
    holding: bool  # holds the stream's persisted-up-to position
    # Seconds its oldest unfinished ID has waited (0: none pending); None: unknown.
    pending_age: float | None = None


@dataclass(frozen=True, slots=True)
class StreamStatus:
    name: str
    head: int | None
    persisted_up_to: int | None  # every ID at or below it is committed or abandoned
    gap: int  # furthest writer's position minus persisted-up-to
    writers: tuple[WriterStatus, ...]
    stalled_by: str | None

    @property
    def stalled(self) -> bool:
        return self.stalled_by is not None


def assess(
    stream: RecordedStream,
    stall_after: float = DEFAULT_STALL_AFTER,
    pending: Mapping[tuple[str, str], float] | None = None,
) -> StreamStatus:
    """The verdicts on one stream; `pending` holds the ages of the writers' oldest
    unfinished IDs, by (stream, writer), where known (`scrape`)."""
    pending = pending or {}
    rows = {r.writer: r for r in stream.rows if not stream.writers or r.writer in stream.writers}

    def age_of(writer: str) -> float | None:
        return pending.get((stream.name, writer))

    if not rows:
        writers = tuple(WriterStatus(w, None, None, 0, False, age_of(w)) for w in stream.writers)
        return StreamStatus(stream.name, stream.head, None, 0, writers, None)
    low = min(r.position for r in rows.values())
    high = max(r.position for r in rows.values())
    writers = tuple(
        WriterStatus(w, None, None, 0, False, age_of(w))
        if (row := rows.get(w)) is None
        else WriterStatus(
            w, row.position, row.age, high - row.position, row.position == low < high, age_of(w)
        )
        for w in list(stream.writers) or sorted(rows)
    )
    stuck = [w for w in writers if w.holding and w.age is not None and w.age > stall_after]
    stalled_by = max(stuck, key=lambda w: w.age or 0.0).writer if stuck else None
    return StreamStatus(stream.name, stream.head, low, high - low, writers, stalled_by)


def positions(found: Sequence[StreamStatus]) -> dict[tuple[str, str], int]:
    """Each writer's position, by (stream, writer), where it has one."""
    return {
        (s.name, w.writer): w.position for s in found for w in s.writers if w.position is not None
    }


def rates(
    before: Sequence[StreamStatus], after: Sequence[StreamStatus], seconds: float
) -> dict[tuple[str, str], float]:
    """How many IDs a second each writer's position moved between two readings."""
    if seconds <= 0:
        return {}
    earlier = positions(before)
    return {
        (s.name, w.writer): (w.position - old) / seconds
        for s in after
        for w in s.writers
        if w.position is not None and (old := earlier.get((s.name, w.writer))) is not None
    }


def pending_ages(metrics_text: str) -> dict[tuple[str, str], float]:
    """The oldest-unfinished-ID ages in one instance's `/metrics` text, by (stream,
    writer); `ValueError` when the text is not the Prometheus text format. An age that
    is not a finite number of seconds (NaN, -3) counts as unknown."""
    return {
        (sample.labels["stream"], sample.labels["writer"]): float(sample.value)
        for family in text_string_to_metric_families(metrics_text)
        if family.name == OLDEST_UNFINISHED_AGE
        for sample in family.samples
        if "stream" in sample.labels and "writer" in sample.labels and _seconds(sample.value)
    }


def _seconds(value: float) -> bool:
    """Whether a sample is a finite, non-negative number of seconds (the parser gives
    an int too large for a float as an int, which `math.isfinite` cannot take)."""
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:
        return False


def scrape(
    instances: Mapping[str, str], timeout: float = 2.0
) -> tuple[dict[tuple[str, str], float], dict[str, str]]:
    """Read every instance's `/metrics` at once (instance name -> base URL of its
    internal HTTP API). Returns the ages found and, per instance that did not answer
    with metrics, why."""

    def one(base: str) -> dict[tuple[str, str], float]:
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"{base!r} is not an http(s) URL")
        url = base.rstrip("/") + "/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read(MAX_METRICS_BYTES + 1)
        if len(body) > MAX_METRICS_BYTES:
            raise ValueError(f"its /metrics is over {MAX_METRICS_BYTES} bytes")
        return pending_ages(body.decode("utf-8", "replace"))

    ages: dict[tuple[str, str], float] = {}
    failed: dict[str, str] = {}
    if not instances:
        return ages, failed
    with ThreadPoolExecutor(max_workers=min(16, len(instances))) as pool:
        futures = {name: pool.submit(one, base) for name, base in instances.items()}
        for name, future in futures.items():
            try:
                ages.update(future.result())
            # HTTPException: whatever answered is not an HTTP server (a bad status
            # line, a body cut short, too many headers).
            except (OSError, ValueError, http.client.HTTPException) as err:
                why = str(getattr(err, "reason", None) or err) or type(err).__name__
                failed[name] = why[:200]
    return ages, failed


def to_json(stream: StreamStatus) -> str:
    return json.dumps({**asdict(stream), "stalled": stream.stalled}, sort_keys=True)
