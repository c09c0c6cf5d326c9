"""Which event writer owns a room: rendezvous hashing of the room id, so every process
agrees without talking, and adding a writer moves only the rooms it wins (about 1/n of
them) instead of reshuffling every room as `hash % n` would."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def owner(room_id: str, writers: Sequence[str]) -> str:
    """The writer that owns `room_id` (stable across processes and runs)."""
    if not writers:
        raise ValueError("no event writers to shard rooms over")
    return max(writers, key=lambda writer: (_score(writer, room_id), writer))


def _score(writer: str, room_id: str) -> bytes:
    # Length-prefixed so ("a", "bc") and ("ab", "c") never collide.
    data = f"{len(writer)}:{writer}:{room_id}".encode()
    return hashlib.blake2b(data, digest_size=8).digest()
