"""The TCP transport's handshakes as state machines (`tcp_protocol`'s model): NAME,
then, with a secret, CHALLENGE, PROOF and SERVER, each side proving it holds the secret
without either computing anything with it for a peer that has not proven itself first.
Lines in, steps out; the nonces are the caller's."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from plait.core.commands import (
    Challenge,
    Command,
    CommandSet,
    Error,
    Name,
    Proof,
    Server,
    to_line,
)
from plait.core.tcp_protocol import LINE_TOO_LONG, clip
from plait.errors import CommandParseError

SAME_SECRET = "set the same replication.secret on every instance"
# Proofs cover this first: another protocol's (or version's) HMAC can never pass.
PROOF_LABEL = "plait-tcp-1"
_HANDSHAKE_COMMANDS = CommandSet()


def proof(key: bytes, role: str, client: str, hub: str, hub_nonce: str, nonce: str) -> str:
    """What the `role` end ("client" or "hub") of the connection between `client` and
    `hub` shows to prove it holds the secret `key`. Names hold no spaces, nonces are hex:
    the message is unambiguous."""
    message = f"{PROOF_LABEL} {role} {client} {hub} {hub_nonce} {nonce}"
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Accepted:
    """The handshake is over: `name` is the peer's."""

    name: str


@dataclass(frozen=True, slots=True)
class Refused:
    """The handshake failed: `text` says why (to the peer in ERROR, and to the log);
    `reason` is how the hub counts it ("handshake", "auth", "name")."""

    text: str
    reason: str = "handshake"


@dataclass(frozen=True, slots=True)
class TellHub:
    """A client's handshake failed because the secrets are set differently: `text` for
    its own log, `to_hub` for the hub's (in ERROR)."""

    text: str
    to_hub: str


@dataclass(slots=True)
class Step:
    """What one received line led to: lines to send, and the outcome once there is one."""

    send: list[str] = field(default_factory=list)
    done: Accepted | Refused | TellHub | None = None


class HubHandshake:
    """The hub's side: NAME first; with a secret, CHALLENGE it and check its PROOF before
    SERVER with the hub's own proof. `nonce` is the hub's fresh random one (the shell
    draws it: the machine has no randomness of its own)."""

    def __init__(self, hub: str, secret: bytes | None, nonce: str) -> None:
        self._hub = hub
        self._secret = secret
        self._nonce = nonce
        self.name: str | None = None  # the client's, once it said NAME
        self.over = False

    @property
    def expecting(self) -> str:
        if self.name is None or self._secret is None:
            return "NAME <name>"
        return "PROOF <nonce> <proof>"

    def receive(self, raw: bytes) -> Step:
        assert not self.over, "the handshake is over"
        step = self._receive(raw)
        if isinstance(step.done, Refused):
            step = Step(done=self._counted(step.done))
        self.over = step.done is not None
        return step

    def timed_out(self, seconds: float) -> Refused:
        self.over = True
        return self._counted(Refused(f"expected {self.expecting} within {seconds:g}s"))

    def too_long(self) -> Refused:
        self.over = True
        return self._counted(Refused(LINE_TOO_LONG))

    def _counted(self, refused: Refused) -> Refused:
        # Once challenged, whatever the client sends but its proof fails to prove it.
        challenged = self.name is not None and self._secret is not None
        if challenged and refused.reason == "handshake":
            return Refused(refused.text, "auth")
        return refused

    def _receive(self, raw: bytes) -> Step:
        expecting = self.expecting
        if self.name is None:
            expecting += " first"
        try:
            command = _HANDSHAKE_COMMANDS.parse(raw)
        except CommandParseError as err:
            return Step(done=Refused(f"expected {expecting}: {err}"))
        if self.name is None:
            return self._named(command, expecting)
        return self._proved(command, expecting)

    def _named(self, command: Command, expecting: str) -> Step:
        if not isinstance(command, Name):
            return Step(done=Refused(f"expected {expecting}, got {command.NAME}"))
        self.name = command.name
        hub = self._hub
        if command.name == hub:
            text = f"NAME {hub} is the hub's own name: name every instance differently"
            return Step(done=Refused(text, "name"))
        if self._secret is None:
            return Step([to_line(Server(hub))], Accepted(command.name))
        return Step([to_line(Challenge(hub, self._nonce))])

    def _proved(self, command: Command, expecting: str) -> Step:
        assert self.name is not None
        assert self._secret is not None
        if isinstance(command, Error):  # a client without the secret says so
            return Step(done=Refused(f"it gave up: {clip(command.text)}", "auth"))
        if not isinstance(command, Proof):
            return Step(done=Refused(f"expected {expecting}, got {command.NAME}"))
        hub, name = self._hub, self.name
        expected = proof(self._secret, "client", name, hub, self._nonce, command.nonce)
        if not hmac.compare_digest(expected, command.proof):
            text = (
                "authentication failed: the proof does not match this hub's "
                f"replication.secret; {SAME_SECRET}"
            )
            return Step(done=Refused(text, "auth"))
        ours = proof(self._secret, "hub", name, hub, self._nonce, command.nonce)
        return Step([to_line(Server(hub, ours))], Accepted(name))


class ClientHandshake:
    """The client's side: NAME, then SERVER, or with a secret on both ends CHALLENGE,
    PROOF and SERVER with the hub's proof. `nonce` is the client's fresh random one."""

    def __init__(self, me: str, secret: bytes | None, nonce: str) -> None:
        self._me = me
        self._secret = secret
        self._nonce = nonce
        self._challenge: Challenge | None = None
        self.over = False

    def start(self) -> str:
        """The first line: this instance's name."""
        return to_line(Name(self._me))

    def receive(self, raw: bytes) -> Step:
        assert not self.over, "the handshake is over"
        expecting = "SERVER or CHALLENGE" if self._challenge is None else "SERVER"
        try:
            command = _HANDSHAKE_COMMANDS.parse(raw)
        except CommandParseError as err:
            step = Step(done=Refused(f"expected {expecting} from the hub: {err}"))
        else:
            if isinstance(command, Error):
                step = Step(done=Refused(f"the hub refused the connection: {command.text}"))
            elif self._challenge is None:
                step = self._first(command)
            else:
                step = self._last(command, self._challenge)
        self.over = step.done is not None
        return step

    def _first(self, command: Command) -> Step:
        if isinstance(command, Challenge):
            return self._prove(command)
        if not isinstance(command, Server):
            return Step(
                done=Refused(f"expected SERVER or CHALLENGE from the hub, got {command.NAME}")
            )
        if self._secret is not None:
            return Step(
                done=TellHub(
                    f"the hub {command.name} did not ask for proof of the replication "
                    f"secret: it has none, and this instance has one: {SAME_SECRET}",
                    f"this instance ({self._me}) has a replication.secret, and the hub did "
                    f"not ask for proof of it: {SAME_SECRET}",
                )
            )
        if command.proof is not None:
            return Step(done=Refused("the hub sent SERVER with a proof nobody asked for"))
        return Step(done=Accepted(command.name))

    def _prove(self, challenge: Challenge) -> Step:
        if self._secret is None:
            return Step(
                done=TellHub(
                    "the hub asks for proof of the replication secret and this instance has "
                    "none: set replication.secret, the same on every instance",
                    f"this instance ({self._me}) has no replication.secret, and the hub asks"
                    f" for proof of it: {SAME_SECRET}",
                )
            )
        self._challenge = challenge
        ours = proof(self._secret, "client", self._me, challenge.name, challenge.nonce, self._nonce)
        return Step([to_line(Proof(self._nonce, ours))])

    def _last(self, command: Command, challenge: Challenge) -> Step:
        assert self._secret is not None
        if not isinstance(command, Server):
            return Step(done=Refused(f"expected SERVER from the hub, got {command.NAME}"))
        hub = challenge.name
        theirs = proof(self._secret, "hub", self._me, hub, challenge.nonce, self._nonce)
        if (
            command.name != hub
            or command.proof is None
            or not hmac.compare_digest(theirs, command.proof)
        ):
            text = (
                "the hub's proof does not match this instance's replication.secret: the "
                f"secrets differ, or this is not the hub; {SAME_SECRET}"
            )
            return Step(done=TellHub(text, text))
        return Step(done=Accepted(hub))


# -- what the hub takes from a client ------------------------------------------------------
