"""Presence: who is syncing right now. Sync workers tell the presence writer (`main`)
when a user's first sync on them starts and their last one ends, by instance name, not
by connection, so a reconnect changes nothing; a worker that stops gracefully clears all
of its users at once (`CLEAR_USER_SYNC`), and one that departs without it is cleared
when its departure is announced. No I/O here: commands and state.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

from plait.core.commands import Named, parse_integer, parse_name, split_args
from plait.errors import CommandParseError


@dataclass(frozen=True, slots=True)
class UserSync:
    """`USER_SYNC <instance> <user> <start|end> <ms>`."""

    NAME: ClassVar[str] = "USER_SYNC"
    instance: str
    user: str
    state: str
    ms: int

    @classmethod
    def from_args(cls, args: str) -> UserSync:
        instance, user, state, ms = split_args(args, 4, "<instance> <user> <start|end> <ms>")
        if state not in ("start", "end"):
            raise CommandParseError(f"state must be start or end, not {state[:20]!r}")
        return cls(
            parse_name(instance, "instance"),
            check_user(user),
            state,
            parse_integer(ms, "ms"),
        )

    def to_args(self) -> str:
        check_user(self.user)
        return f"{parse_name(self.instance, 'instance')} {self.user} {self.state} {self.ms}"


MAX_ID = 255  # characters in a room or user id


def check_id(value: str, what: str) -> str:
    """A room or user id as it may travel in a command line and be stored in PostgreSQL:
    1-255 printable characters, no whitespace (so no control characters, NULs or lone
    surrogates); `CommandParseError` naming `what` otherwise."""
    parse_name(value, what)
    if len(value) > MAX_ID or not value.isprintable():
        raise CommandParseError(
            f"bad {what} {value[:40]!r}: it must be 1-{MAX_ID} printable characters "
            "without whitespace"
        )
    return value


def check_user(user: str) -> str:
    return check_id(user, "user")


@dataclass(frozen=True, slots=True)
class ClearUserSync(Named):
    """`CLEAR_USER_SYNC <instance>`: every user syncing on that instance stopped."""

    NAME: ClassVar[str] = "CLEAR_USER_SYNC"


class Syncing:
    """The presence writer's view: users syncing, per sync worker."""

    def __init__(self) -> None:
        self._by_instance: dict[str, set[str]] = {}

    def apply(self, command: UserSync | ClearUserSync) -> None:
        if isinstance(command, ClearUserSync):
            self._by_instance.pop(command.name, None)
        elif command.state == "start":
            self._by_instance.setdefault(command.instance, set()).add(command.user)
        else:
            self._by_instance.get(command.instance, set()).discard(command.user)

    def online(self) -> set[str]:
        return set().union(*self._by_instance.values())


class Local:
    """A sync worker's own count of running syncs per user: it speaks only when a
    user's first sync starts (`start`) or last one ends (`end`)."""

    def __init__(self) -> None:
        self._running: Counter[str] = Counter()

    def begin(self, user: str) -> bool:
        """True when this is the user's first running sync here."""
        self._running[user] += 1
        return self._running[user] == 1

    def end(self, user: str) -> bool:
        """True when that was the user's last running sync here."""
        self._running[user] -= 1
        if self._running[user] <= 0:
            del self._running[user]
            return True
        return False
