"""The `plait` source's options, parsed and checked before anything runs (no I/O): an
option it does not know is an error naming the one most likely meant (another source's
name for it, or the closest spelling), as a misspelt one would otherwise be ignored."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from plait.errors import ConfigError

DEFAULT_MAX_IDS = 250_000
PARTITIONINGS = ("slices", "writers")
OPTIONS = (
    "dsn",
    "stream",
    "table",
    "startingToken",
    "startToken",
    "endToken",
    "maxRowsPerTrigger",
    "minRowsPerTrigger",
    "maxTriggerDelay",
    "maxIdsPerPartition",
    "partitioning",
    "metadataColumns",
)
# metadataColumns: what a user may ask for, and the column each one adds to the rows.
METADATA = {"stream": "_stream", "commitTimestamp": "_commit_timestamp"}
DEFAULT_MAX_TRIGGER_DELAY = 15 * 60.0  # seconds: the Kafka source's default


@dataclass(frozen=True, slots=True)
class Options:
    dsn: str
    stream: str
    table: str | None
    starting: str
    start: str
    end: str
    max_rows: int | None
    min_rows: int | None
    max_delay: float  # seconds a trigger waits for min_rows before it reads fewer
    max_ids: int
    by_writer: bool
    metadata: tuple[str, ...] = ()  # keys of METADATA, in the order given

    @classmethod
    def parse(cls, raw: Mapping[str, str]) -> Options:
        options = {str(k).lower(): str(v) for k, v in raw.items()}
        known = {name.lower() for name in OPTIONS}
        for key in raw:
            # A misspelt option would be ignored and the read start from the default.
            if str(key).lower() not in known:
                hint = suggestion(str(key))
                raise ConfigError(
                    f"plait source: unknown option {str(key)[:100]!r}"
                    + (f" (did you mean {hint!r}?)" if hint else "")
                    + f"; the options are {', '.join(OPTIONS)}"
                )
        for required in ("dsn", "stream"):
            if not options.get(required):
                raise ConfigError(f'plait source: .option("{required}", ...) is required')
        max_rows = _positive(options, "maxrowspertrigger")
        min_rows = _positive(options, "minrowspertrigger")
        if why := trigger_rows_conflict(min_rows, max_rows):
            raise ConfigError(
                f"plait source: minRowsPerTrigger ({min_rows}) is above maxRowsPerTrigger "
                f"({max_rows}): {why}"
            )
        if "maxtriggerdelay" in options and min_rows is None:
            raise ConfigError(
                "plait source: maxTriggerDelay bounds how long a trigger waits for "
                "minRowsPerTrigger rows; it does nothing without minRowsPerTrigger"
            )
        return cls(
            dsn=options["dsn"],
            stream=options["stream"],
            table=options.get("table") or None,
            starting=options.get("startingtoken", "earliest"),
            start=options.get("starttoken", "earliest"),
            end=options.get("endtoken", "latest"),
            max_rows=max_rows,
            min_rows=min_rows,
            max_delay=_duration(options, "maxtriggerdelay", DEFAULT_MAX_TRIGGER_DELAY),
            max_ids=_positive(options, "maxidsperpartition") or DEFAULT_MAX_IDS,
            by_writer=_partitioning(options) == "writers",
            metadata=_metadata(options.get("metadatacolumns", "")),
        )


# Other sources' names for plait's options: Kafka's, JDBC's, and plait's own batch and
# streaming names given to the other kind of read.
_OTHER_NAMES = {
    "maxoffsetspertrigger": "maxRowsPerTrigger",
    "minoffsetspertrigger": "minRowsPerTrigger",
    "maxfilespertrigger": "maxRowsPerTrigger",
    "startingoffsets": "startingToken",
    "startingoffsetsbytimestamp": "startingToken",
    "endingoffsets": "endToken",
    "url": "dsn",
    "dbtable": "table",
    "numpartitions": "maxIdsPerPartition",
    "includeheaders": "metadataColumns",
}


def suggestion(key: str) -> str | None:
    """The option a user most likely meant by an unknown `key`: its counterpart in
    another source, or the closest spelling of one of plait's."""
    folded = key.strip().lower()
    if folded in _OTHER_NAMES:
        return _OTHER_NAMES[folded]
    by_folded = {name.lower(): name for name in OPTIONS}
    started = [name for name in by_folded if len(folded) >= 4 and name.startswith(folded)]
    if len(started) == 1:
        return by_folded[started[0]]
    close = difflib.get_close_matches(folded, list(by_folded), n=1, cutoff=0.75)
    return by_folded[close[0]] if close else None


def trigger_rows_conflict(min_rows: int | None, max_rows: int | None) -> str | None:
    """Why a minimum and a maximum of rows per trigger cannot both hold, if they cannot."""
    if min_rows is not None and max_rows is not None and min_rows > max_rows:
        return "no batch could satisfy both"
    return None


def _named(key: str) -> str:
    """An option's documented spelling, from its folded one."""
    return next((name for name in OPTIONS if name.lower() == key), key)


def _metadata(value: str) -> tuple[str, ...]:
    by_folded = {name.lower(): name for name in METADATA}
    asked = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [part for part in asked if part.lower() not in by_folded]
    if unknown:
        raise ConfigError(
            f"plait source: option metadataColumns names {unknown[0][:100]!r}; it takes a "
            f"comma-separated list of {', '.join(METADATA)}"
        )
    return tuple(dict.fromkeys(by_folded[part.lower()] for part in asked))


def _partitioning(options: Mapping[str, str]) -> str:
    value = options.get("partitioning", "slices")
    if value.lower() not in PARTITIONINGS:
        raise ConfigError(
            f"plait source: option partitioning must be one of {list(PARTITIONINGS)}, not {value!r}"
        )
    return value.lower()


# ASCII digits only: int() would also take "1_000" and digits of other scripts.
_DIGITS = re.compile(r"[0-9]{1,18}")


def _positive(options: Mapping[str, str], key: str) -> int | None:
    value = options.get(key)
    if value is None:
        return None
    number = int(value) if _DIGITS.fullmatch(value.strip()) else 0
    if number < 1:
        raise ConfigError(
            f"plait source: option {_named(key)} must be a positive integer, not {value!r}"
        )
    return number


_DURATION = re.compile(r"([0-9]{1,9})\s*(ms|s|m|min|h|d)")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def duration(value: str) -> float:
    """Seconds from "500ms", "30s", "15m", "2h" or "1d" (as the Kafka source takes
    maxTriggerDelay, with a unit always); `ValueError` otherwise."""
    match = _DURATION.fullmatch(value.strip().lower())
    if match is None:
        raise ValueError(f"a duration such as 500ms, 30s, 15m or 1h, not {value!r}")
    return int(match.group(1)) * _SECONDS[match.group(2)]


def _duration(options: Mapping[str, str], key: str, default: float) -> float:
    value = options.get(key)
    if value is None:
        return default
    try:
        return duration(value)
    except ValueError as err:
        raise ConfigError(f"plait source: option {_named(key)} must be {err}") from None
