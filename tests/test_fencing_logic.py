"""`HoldWatch`: when a writer holding a stream's linear position is a fencing candidate
(pure, no database)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.core.fencing import HoldWatch


def test_a_writer_that_holds_without_moving_becomes_a_candidate_after_fence_after() -> None:
    watch = HoldWatch(1.0, own="w3")
    assert watch.candidate({"w1": 5, "w2": 5, "w3": 5}, 0.0) is None  # level: nobody holds
    assert watch.candidate({"w1": 5, "w2": 9, "w3": 9}, 10.0) is None  # held since 10.0
    assert watch.candidate({"w1": 5, "w2": 12, "w3": 12}, 10.9) is None
    assert watch.candidate({"w1": 5, "w2": 12, "w3": 12}, 11.0) == "w1"
    watch.tried("w1", 11.0, fenced=False)  # it was alive
    assert watch.candidate({"w1": 5, "w2": 12, "w3": 12}, 11.5) is None  # waits again
    assert watch.candidate({"w1": 5, "w2": 12, "w3": 12}, 12.0) == "w1"


def test_a_holder_that_moves_starts_over() -> None:
    watch = HoldWatch(1.0)
    watch.candidate({"w1": 5, "w2": 9}, 0.0)
    assert watch.candidate({"w1": 6, "w2": 9}, 0.9) is None  # moved: held since 0.9
    assert watch.candidate({"w1": 6, "w2": 9}, 1.5) is None
    assert watch.candidate({"w1": 6, "w2": 9}, 2.0) == "w1"


def test_this_instance_is_never_a_candidate() -> None:
    watch = HoldWatch(1.0, own="w1")
    watch.candidate({"w1": 5, "w2": 9}, 0.0)
    assert watch.candidate({"w1": 5, "w2": 9}, 60.0) is None


def test_a_fenced_writer_is_fenced_again_quickly_while_it_keeps_holding() -> None:
    watch = HoldWatch(1.0)
    watch.candidate({"w1": 5, "w2": 9}, 0.0)
    assert watch.candidate({"w1": 5, "w2": 9}, 1.0) == "w1"
    watch.tried("w1", 1.0, fenced=True)
    assert watch.is_fenced("w1")
    assert watch.candidate({"w1": 9, "w2": 9}, 1.01) is None  # moved up to the others
    assert watch.candidate({"w1": 9, "w2": 15}, 1.05) is None
    assert watch.candidate({"w1": 9, "w2": 15}, 1.2) == "w1"  # after fence_after / 10
    watch.tried("w1", 1.2, fenced=False)  # a new run came back: alive
    assert not watch.is_fenced("w1")
    assert watch.candidate({"w1": 9, "w2": 15}, 1.3) is None


def test_a_fenced_writer_due_again_on_every_tick_does_not_starve_another_holder() -> None:
    """Both writers died, w1 first (fenced and following w2), and both came to rest at
    the same moment, level below the sequence head. Fencing w1 again cannot move it (w2
    is as far as it may go); only w2 can move, and it is tried once it held fence_after,
    though w1 is due again (after fence_after / 10) on every tick."""
    watch = HoldWatch(1.0)  # a reader's fencer, ticking every 0.1 s
    watch.candidate({"w1": 207, "w2": 310}, 0.0)
    assert watch.candidate({"w1": 207, "w2": 310}, 1.0) == "w1"
    watch.tried("w1", 1.0, fenced=True)
    positions = {"w1": 321, "w2": 321}  # learnt in one refresh: held since the same tick
    tried = []
    now = 1.1
    while now < 4.0 and "w2" not in tried:
        head = 329 if watch.needs_head(positions, now) else None
        chosen = watch.candidate(positions, now, head)
        if chosen is not None:
            tried.append(chosen)
            watch.tried(chosen, now, fenced=True)  # w1 stays where it is
        now = round(now + 0.1, 3)
    assert "w2" in tried, f"w2 never tried in 3 s of ticks, w1 tried {len(tried)} times"
    assert now <= 1.1 + 1.0 + 0.3  # held fence_after, then tried within a tick or two


_DUE = st.lists(st.sampled_from(["w1", "w2", "w3", "w4"]), unique=True, min_size=1)


@given(_DUE, _DUE, st.sampled_from([0.02, 0.05, 0.1, 0.5]))
def test_every_holder_is_tried_within_its_wait_and_a_tick_per_holder(
    holding: list[str], fenced: list[str], tick: float
) -> None:
    """Liveness: however many holders are due again quickly (fenced ones), and though
    no attempt moves anybody, each holder is tried within its wait plus one tick per
    holder: the one whose last attempt is oldest goes first."""
    fence_after = 1.0
    watch = HoldWatch(fence_after, own="live")
    positions = dict.fromkeys(holding, 5) | {"live": 9}
    for writer in set(fenced) & set(holding):
        watch.tried(writer, -10.0, fenced=True)
    watch.candidate(positions, 0.0)  # all hold from 0.0
    tries: dict[str, list[float]] = {writer: [0.0] for writer in holding}
    now = 0.0
    for _ in range(round(3 * fence_after / tick)):
        now += tick
        chosen = watch.candidate(positions, now)
        if chosen is not None:
            watch.tried(chosen, now, fenced=watch.is_fenced(chosen))  # moved nobody
            tries[chosen].append(now)
    for writer, times in tries.items():
        wait = fence_after * (0.1 if watch.is_fenced(writer) else 1.0)
        bound = wait + tick * len(holding) + 1e-6
        gaps = [b - a for a, b in zip([*times], [*times[1:], now], strict=True)]
        assert max(gaps) <= bound, f"{writer} waited {max(gaps):.2f} s for a try: {times}"


def test_fence_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        HoldWatch(0)


_STEPS = st.lists(
    st.tuples(
        st.dictionaries(st.sampled_from(["w1", "w2", "w3"]), st.integers(0, 3), min_size=3),
        st.floats(0, 0.7),
        st.booleans(),
    ),
    max_size=60,
)


@given(_STEPS)
def test_candidates_held_the_stream_long_enough(
    steps: list[tuple[dict[str, int], float, bool]],
) -> None:
    """Model: positions only grow; a candidate is a lowest writer, not level with the
    top, and neither moved nor was level with the top within the last fence_after."""
    fence_after = 1.0
    watch = HoldWatch(fence_after, own="w3")
    positions = {"w1": 0, "w2": 0, "w3": 0}
    last_change = dict.fromkeys(positions, 0.0)
    last_level = dict.fromkeys(positions, 0.0)
    last_try: dict[str, float] = {}
    now = 0.0
    watch.candidate(positions, now)
    for growth, pause, alive in steps:
        now += pause
        for writer, step in growth.items():
            if step:
                positions[writer] += step
                last_change[writer] = now
        top = max(positions.values())
        for writer, position in positions.items():
            if position == top:
                last_level[writer] = now
        chosen = watch.candidate(positions, now)
        if chosen is None:
            continue
        assert chosen != "w3"
        assert positions[chosen] == min(positions.values()) < top
        held_since = max(last_change[chosen], last_level[chosen])
        wait = fence_after * (0.1 if watch.is_fenced(chosen) else 1.0)
        assert now - held_since >= wait - 1e-9
        assert now - last_try.get(chosen, float("-inf")) >= wait - 1e-9
        watch.tried(chosen, now, fenced=not alive)
        last_try[chosen] = now


def test_level_writers_below_the_sequence_head_are_candidates_once_quiet() -> None:
    """Every writer died: all level, but the sequence handed out IDs above them (the
    last rows of a dead writer may be committed and never announced)."""
    watch = HoldWatch(1.0, own="reader")
    positions = {"w1": 50, "w2": 50}
    assert not watch.needs_head(positions, 0.0)
    assert not watch.needs_head(positions, 0.9)  # not quiet for long enough yet
    assert watch.needs_head(positions, 1.0)
    assert not watch.needs_head(positions, 1.1)  # asked just now
    assert watch.candidate(positions, 1.0, head=50) is None  # at the head: nothing held
    assert watch.candidate(positions, 1.0, head=57) in {"w1", "w2"}
    assert not watch.needs_head({"w1": 50, "w2": 60}, 5.0)  # not level: no head needed


def test_a_holder_gets_its_turn_while_another_is_fenced_again_without_moving() -> None:
    """Every writer dead and level below the sequence head (a checker run: four writers
    killed within 4 s). w0 was fenced once, so it is fenced again every fence_after / 10
    while it holds; each time it moves nothing (nothing of it is above the others).
    Before: the holders went in the order they had held the stream, w0 first, and w0
    was due again at every look, so w1, whose last rows only a fence of w1 claims, never
    had its turn: readers stalled until a writer came back (8 s, in CI)."""
    fence_after, tick, head = 1.0, 0.1, 922
    watch = HoldWatch(fence_after, own="reader")
    watch.candidate({"w0": 914, "w1": 900}, 0.0)  # w0 holds from 0.0, w1 from 0.5
    watch.candidate({"w0": 914, "w1": 914}, 0.5)
    watch.tried("w0", 0.5, fenced=True)
    positions = {"w0": 914, "w1": 914}
    now, chosen = 0.5, []
    while now < 0.5 + 3 * fence_after and "w1" not in chosen:
        now = round(now + tick, 6)
        seen_head = head if watch.needs_head(positions, now) else None
        writer = watch.candidate(positions, now, seen_head)
        if writer is not None:
            chosen.append(writer)
            watch.tried(writer, now, fenced=True)  # w0's fence moves nothing
    assert "w1" in chosen, f"only {sorted(set(chosen))} fenced in {3 * fence_after:g} s"


def test_a_fence_that_moved_nothing_waits_for_a_position_to_move() -> None:
    """Every writer dead, level below the sequence head, each fenced once without
    moving. Before, a reader fenced each again every fence_after / 10, forever (a row
    lock and a scan of the server's processes each time), and read the head as often.
    Now nothing is tried, and the head not read, until some position moves; then the
    holders are tried again as before."""
    fence_after, tick, head = 1.0, 0.1, 922
    watch = HoldWatch(fence_after, own="reader")
    positions = {"w0": 914, "w1": 914}
    watch.candidate(positions, 0.0)
    tries: list[tuple[float, str]] = []
    heads = 0
    now = 0.0
    while now < 60.0:
        now = round(now + tick, 6)
        seen_head = None
        if watch.needs_head(positions, now):
            heads += 1
            seen_head = head
        writer = watch.candidate(positions, now, seen_head)
        if writer is not None:
            tries.append((now, writer))
            watch.tried(writer, now, fenced=True, moved=False)
    assert sorted(w for _, w in tries) == ["w0", "w1"], tries  # once each, in the first
    assert max(t for t, _ in tries) <= 2 * fence_after + 2 * tick
    assert heads <= 2
    # A writer comes back and writes: w0 is due again, then w1 once the others moved on.
    positions = {"w0": 914, "w1": 930}
    assert watch.candidate(positions, now + tick) is None  # w1 ahead: not held
    later = now + tick + fence_after / 10
    assert watch.candidate(positions, later) == "w0"  # fenced before: due quickly


def test_a_fence_that_moved_the_writer_is_repeated_as_before() -> None:
    watch = HoldWatch(1.0)
    watch.candidate({"w1": 5, "w2": 9}, 0.0)
    assert watch.candidate({"w1": 5, "w2": 9}, 1.0) == "w1"
    watch.tried("w1", 1.0, fenced=True, moved=True)
    assert watch.candidate({"w1": 9, "w2": 15}, 1.05) is None
    assert watch.candidate({"w1": 9, "w2": 15}, 1.2) == "w1"
    watch.tried("w1", 1.2, fenced=True, moved=False)  # w2 went on meanwhile: not futile
    assert watch.candidate({"w1": 9, "w2": 20}, 1.35) == "w1"
