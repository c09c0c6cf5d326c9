"""free_port: below the ephemeral range, never a taken port, never twice."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from plait import ports


def test_ports_lie_below_the_ephemeral_range_and_are_free_and_distinct() -> None:
    ephemeral = ports.ephemeral_range()
    if ephemeral is None:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    assert all(20_000 <= port < ephemeral[0] for port in picked)
    for port in picked[:20]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


class _Scripted:
    """Stands in for the random source: hands out the given ports in turn."""

    def __init__(self, picks: list[int]) -> None:
        self._picks: Iterator[int] = iter(picks)

    def randrange(self, start: int, stop: int) -> int:
        port = next(self._picks)
        assert start <= port < stop
        return port


def test_a_taken_port_is_passed_over(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    range_file = tmp_path / "range"
    range_file.write_text("40000\t60999\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", range_file)
    candidates = (p for p in range(39_999, 20_000, -1) if _bindable(p))
    taken, free = next(candidates), next(candidates)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", taken))
        listener.listen()
        monkeypatch.setattr(ports, "_random", _Scripted([taken, free]))
        assert ports.free_port() == free


def test_without_room_below_the_range_the_kernel_picks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    range_file = tmp_path / "range"
    range_file.write_text("1024 65535\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", range_file)
    monkeypatch.setattr(ports, "_random", _Scripted([]))  # any pick would fail
    assert 1024 <= ports.free_port() <= 65535
    range_file.write_text("garbage\n")
    assert ports.free_port() > 0


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
