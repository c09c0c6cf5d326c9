"""What every process of the chat service declares alike: the presence commands and the
caches (a room change invalidates its member list and each member's rooms in one row),
and which instances write events."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from plait.caches.cached import CachedFunction
from plait.demo import presence
from plait.errors import ConfigError
from plait.instance import Instance

ROOM_CHANGED = "room_changed"


@dataclass(frozen=True, slots=True)
class Caches:
    room_members: CachedFunction[[str], list[str]]
    rooms_for_user: CachedFunction[[str], list[str]]


def declare_shared(instance: Instance, on_presence: Callable[[Any], None] | None = None) -> Caches:
    """What every process of the service declares: the presence commands (every peer
    must know them: the hub relays them to all) and the caches."""
    listener = on_presence or (lambda command: None)
    instance.register_command(presence.UserSync, listener)
    instance.register_command(presence.ClearUserSync, listener)
    return declare_caches(instance)


def declare_caches(instance: Instance) -> Caches:
    """The caches every process has; one room change invalidates the member list and
    each member's entries everywhere, in one row (`invalidate_batch`)."""

    async def joined(column: str, where: str, value: str) -> list[str]:
        """`column` of the joined memberships whose `where` is `value`."""
        query = sql.SQL(
            "SELECT {c} FROM current_members WHERE {w} = %s AND membership = 'join' ORDER BY 1"
        ).format(c=sql.Identifier(column), w=sql.Identifier(where))
        async with instance.db.connection() as conn:
            cursor = await conn.execute(query, (value,))
            return [found for (found,) in await cursor.fetchall()]

    @instance.caches.cached(name="room_members")
    async def room_members(room_id: str) -> list[str]:
        return await joined("user_id", "room_id", room_id)

    @instance.caches.cached(name="rooms_for_user")
    async def rooms_for_user(user_id: str) -> list[str]:
        return await joined("room_id", "user_id", user_id)

    @instance.caches.pseudo_cache(ROOM_CHANGED)
    def room_changed(room_id: str, users: tuple[str, ...]) -> Iterator[tuple[str, tuple[str]]]:
        yield (room_members.name, (room_id,))
        for user in users:
            yield (rooms_for_user.name, (user,))

    return Caches(room_members, rooms_for_user)


def event_writers(instance: Instance) -> list[str]:
    for stream in instance.config.streams:
        if stream.name == "events":
            return list(stream.writers)
    raise ConfigError("the chat service needs an 'events' stream in the configuration")
