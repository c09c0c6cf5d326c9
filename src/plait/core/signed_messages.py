"""Redis messages signed with the deployment's secret (R-RP-9). No I/O.

Over Redis, anyone who may PUBLISH on a deployment's channel reaches every instance. With
`replication.secret` set, each message (one PUBLISH: a batch of command lines) travels as

    <mac> <sender> <run> <seq> <ms>\\n<line>\\n<line>...

- `mac`: HMAC-SHA256, in hex, of everything after `<mac> `, keyed with the secret and
  bound to the channel (a message replayed on another deployment's channel does not
  verify, even with the same secret). One HMAC per message, not per line.
- `sender`: the publishing instance's name. Inside the signed part, so only holders of
  the secret can claim a name.
- `run`: random, one per connection of the publisher; `seq`: 1, 2, 3... within a run.
  Redis hands one publisher's messages to a subscriber in order and drops none while
  the subscription lives (a subscriber that falls behind is disconnected), so on one
  subscription the seqs of a run follow each other without a gap.
- `ms`: the sender's wall clock, checked only for the first message of a run seen on a
  subscription.

What a receiver (`Verifier`) keeps, per subscription ("session") and across them:
- A message whose mac does not verify is refused whole; its lines are never parsed.
- On a session, a run's messages are accepted in seq order, each exactly one after the
  last: one at or below the last is a replay (refused); one past the next means a
  message was lost or what came before was replayed out of context, and the session
  must start over (`Refused.restart`: reconnect, catch up from the database).
- The first message of a run on a session must be newer than any message of that run
  accepted before (on any session of this process) and stamped within `max_skew_ms` of
  the receiver's clock.
- A line that speaks for an instance (RDATA, POSITION, DEPART) must name the sender
  (`foreign`). A FENCED names another writer by nature: any holder of the secret may
  send one, and receivers believe it only once the database shows the fence.

Why a replayed message is then harmless. An attacker who can SUBSCRIBE sees signed
messages and can PUBLISH them again, unchanged (any change breaks the mac). On a session
that saw the original, the copy is at or below its run's last seq: refused. On a session
that did not (it subscribed later), the copy is accepted only as the first of its run,
followed by nothing but the run's next seq: the session then sees a gap-free stretch of
what the sender really sent, in order, exactly as if it had subscribed earlier, and the
replication rules hold for that as for any session: RDATA counts only after a POSITION
on the session, a POSITION whose `prev` is ahead of the receiver catches up from the
database first, positions never move backwards, RDATA at or below the receiver's
position is dropped. When the real traffic then arrives past a gap, the session starts
over. What such a copy can still do is repeat, within `max_skew_ms` of its sending, a
line that is not about positions (DEPART, REPLICATE, an application's command) to a
process that never got the original.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections import OrderedDict
from dataclasses import dataclass

from plait.core.commands import MAX_LINE_BYTES

_DOMAIN = b"plait redis message v1\n"
_MAC_HEX = 64  # SHA-256 in hex
_LOOKS_SIGNED = re.compile(rb"[0-9a-f]{64} ")
_NAME = re.compile(rb"[^\s]+")
# The header line is a few dozen bytes (instance names are short); longer is not ours.
_MAX_HEADER_BYTES = 1024
# A message holds lines of at most MAX_LINE_BYTES (a longer batch is split by the
# publisher), so nothing larger is worth hashing.
MAX_MESSAGE_BYTES = MAX_LINE_BYTES + _MAC_HEX + 1 + _MAX_HEADER_BYTES + 1
# Runs remembered per sender across sessions: replays of older runs fall to the clock.
_RUNS_KEPT = 16
_SENDERS_KEPT = 4096

# Reasons a message or line is refused (metric labels).
UNSIGNED = "unsigned"  # no signature: a process without the secret, or a stranger
BAD_SIGNATURE = "bad_signature"  # signed, but with another secret (or altered)
SIGNED_WITHOUT_SECRET = "signed_without_secret"  # we have no secret; the sender does
MALFORMED = "malformed"  # verified, but the header is not ours
REPLAYED = "replayed"  # at or below what this run already sent here
STALE = "stale"  # first of its run here, stamped too far from our clock
GAP = "gap"  # a message of the run is missing on this session
FOREIGN = "foreign"  # a line speaking for another instance than its signed sender
OVERSIZED = "oversized"  # larger than any message of ours


def key_of(secret: str) -> bytes:
    """The HMAC key of a secret; ValueError when it is empty."""
    if not secret:
        raise ValueError("the replication secret is empty")
    return secret.encode()


def _base(key: bytes, channel: str) -> hmac.HMAC:
    return hmac.new(key, _DOMAIN + channel.encode() + b"\n", hashlib.sha256)


class Signer:
    """Signs the messages of one run (one connection of one publisher), in order."""

    def __init__(self, key: bytes, channel: str, sender: str, run: str) -> None:
        if not _NAME.fullmatch(sender.encode()) or not _NAME.fullmatch(run.encode()):
            raise ValueError("sender and run must be non-empty and hold no whitespace")
        self._base = _base(key, channel)
        self._prefix = f"{sender} {run} ".encode()
        self._seq = 0

    def sign(self, body: bytes, now_ms: int) -> bytes:
        """`body` (lines joined by newlines) as the next message of the run."""
        self._seq += 1
        header = b"%s%d %d" % (self._prefix, self._seq, now_ms)
        mac = self._base.copy()
        mac.update(header)
        mac.update(b"\n")
        mac.update(body)
        return b"%s %s\n%s" % (mac.hexdigest().encode(), header, body)


@dataclass(frozen=True, slots=True)
class Accepted:
    """A verified message from `sender`: its lines are all but the first (the header)."""

    sender: bytes


@dataclass(frozen=True, slots=True)
class Refused:
    """A refused message: why (a metric label), who sent it when that is known (the
    signature verified), and whether the session must start over."""

    reason: str
    sender: bytes | None = None
    detail: str = ""
    restart: bool = False


def looks_signed(message: bytes) -> bool:
    """Whether `message` begins like a signed one (no command line does: command names
    start with a capital)."""
    return _LOOKS_SIGNED.match(message) is not None


class Verifier:
    """Checks signed messages on one channel for one process; `new_session()` when a
    subscription starts."""

    def __init__(self, key: bytes, channel: str, max_skew_ms: int) -> None:
        if max_skew_ms <= 0:
            raise ValueError("max_skew_ms must be positive")
        self._base = _base(key, channel)
        self._max_skew_ms = max_skew_ms
        self._session: dict[tuple[bytes, bytes], int] = {}  # (sender, run) -> last seq
        self._runs: OrderedDict[bytes, OrderedDict[bytes, int]] = OrderedDict()

    def new_session(self) -> None:
        """A new subscription: no run has been seen on it yet."""
        self._session.clear()

    def check(self, message: bytes, now_ms: int) -> Accepted | Refused:
        """Whether `message` comes from a holder of the secret, fresh and in order."""
        if len(message) > MAX_MESSAGE_BYTES:
            return Refused(OVERSIZED, detail=f"{len(message)} bytes")
        mac = self._base.copy()
        mac.update(memoryview(message)[_MAC_HEX + 1 :])
        if (
            not hmac.compare_digest(mac.hexdigest().encode(), message[:_MAC_HEX])
            or message[_MAC_HEX : _MAC_HEX + 1] != b" "  # the one byte the mac leaves out
        ):
            return Refused(BAD_SIGNATURE if looks_signed(message) else UNSIGNED)
        start = _MAC_HEX + 1
        end = message.find(b"\n", start, start + _MAX_HEADER_BYTES + 1)
        if end < 0 and len(message) <= start + _MAX_HEADER_BYTES:
            end = len(message)  # no lines (the publisher never sends such a message)
        fields = message[start:end].split(b" ") if end >= 0 else []
        # Only a holder of the secret gets here: the checks keep our own format, not
        # an attacker, out (no regex: this runs for every message).
        if len(fields) != 4 or not fields[0] or not fields[1]:
            return Refused(MALFORMED, detail="the header of a verified message is not plait's")
        sender, run = fields[0], fields[1]
        try:
            seq, ms = int(fields[2]), int(fields[3])
        except ValueError:
            seq = ms = 0
        if seq < 1:
            return Refused(MALFORMED, sender, "the header of a verified message is not plait's")
        key = (sender, run)
        last = self._session.get(key)
        if last is not None:
            if seq <= last:
                return Refused(REPLAYED, sender, f"seq {seq} after {last}")
            if seq != last + 1:
                return Refused(GAP, sender, f"seq {seq} after {last}", restart=True)
        else:
            runs = self._runs.get(sender)
            before = None if runs is None else runs.get(run)
            if before is not None and seq <= before:
                return Refused(REPLAYED, sender, f"seq {seq}, seen up to {before}")
            if abs(now_ms - ms) > self._max_skew_ms:
                return Refused(STALE, sender, f"stamped {(ms - now_ms) / 1000:+.1f} s")
        self._session[key] = seq
        self._remember(sender, run, seq)
        return Accepted(sender)

    def _remember(self, sender: bytes, run: bytes, seq: int) -> None:
        runs = self._runs.get(sender)
        if runs is None:
            runs = self._runs[sender] = OrderedDict()
            while len(self._runs) > _SENDERS_KEPT:
                self._runs.popitem(last=False)
        known = run in runs
        runs[run] = seq
        if known:
            return
        while len(runs) > _RUNS_KEPT:
            runs.popitem(last=False)


_RDATA = b"RDATA "
_POSITION = b"POSITION "
_DEPART = b"DEPART "


def foreign(line: bytes, sender: bytes) -> bool:
    """Whether `line` speaks for another instance than `sender`: its RDATA, POSITION or
    DEPART. (A FENCED is about another writer by nature: receivers check it against
    the database.)"""
    if line.startswith(_RDATA):
        return not _names(line, len(_RDATA), sender)
    if line.startswith(_POSITION):
        return not _names(line, len(_POSITION), sender)
    if line.startswith(_DEPART):
        return line[len(_DEPART) :] != sender
    return False


def _names(line: bytes, stream_at: int, instance: bytes) -> bool:
    """Whether the instance field of `<command> <stream> <instance> ...` is `instance`
    (found without copying the line: an RDATA line may hold a 1 MiB row)."""
    start = line.find(b" ", stream_at) + 1
    end = start + len(instance)
    return start > 0 and line.startswith(instance, start) and line.find(b" ", start, end + 1) == end
