"""The replication handler's settings, with their defaults and bounds in one place: the
handler (`ReplicationHandler`) takes a `HandlerOptions` as it is, and the configuration's
`replication` section is one with the transports' settings added
(`plait.config.ReplicationConfig`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from plait.core.inbound import DEFAULT_INBOUND_QUEUE
from plait.options import Options
from plait.replication.defaults import MAX_PAGE_LIMIT


class HandlerOptions(Options):
    """How often a writer announces itself, how catch-up reads, how much may wait."""

    announce_interval: float = Field(1.0, gt=0)
    """Seconds between a writer's announcements of where it stands."""
    # Pages double after every full page up to the largest, so a reader that missed a
    # few rows reads them in one small query, and one that missed a million in ~100.
    catch_up_page: int = Field(100, ge=1, le=MAX_PAGE_LIMIT)
    """Rows in the first page of a catch-up query; each full page doubles it."""
    catch_up_page_max: int = Field(10_000, ge=1, le=MAX_PAGE_LIMIT)
    """The largest catch-up page."""
    inbound_queue: int = Field(DEFAULT_INBOUND_QUEUE, ge=1, le=10_000_000)
    """Replication commands one stream may have waiting on one connection: past it the
    stream drops what waits and reads those rows from the database (an in-memory stream:
    from its writer over HTTP), still exactly once and in order (R-RP-9)."""

    @model_validator(mode="after")
    def _check_pages(self) -> HandlerOptions:
        if self.catch_up_page > self.catch_up_page_max:
            raise ValueError("catch_up_page must not exceed catch_up_page_max")
        return self
