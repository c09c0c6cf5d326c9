"""What the parts of one writer's generator share (`Shared`), made once by the
generator and handed to each part, rather than each constructor naming them all."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from plait.core.positions import PositionTracker
from plait.core.spec import StreamSpec
from plait.storage.database import Database
from plait.storage.stream_store import StreamStore
from plait.streams.outbox import Outbox


@dataclasses.dataclass(frozen=True, slots=True)
class Shared:
    """One writer of one stream, as its generator's parts see it."""

    db: Database
    spec: StreamSpec
    instance_name: str
    store: StreamStore
    tracker: PositionTracker  # pure position logic
    outbox: Outbox  # everything replication hears of this writer
    # Our position may have moved since `before`: store it soon, post it to the outbox.
    poke_if_moved: Callable[[int], None]
    closed: Callable[[], bool]  # the generator is closing: nothing more completes

    @property
    def name(self) -> str:
        """The stream's name."""
        return self.spec.name
