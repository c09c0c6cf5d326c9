"""The outbox, the one hand-off from a writer to replication (`plait.streams.outbox`):
what it keeps, and when it runs its reader. No database: its rows are built here."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from plait.storage.stream_tables import StreamRow
from plait.streams.outbox import Outbox


def row(stream_id: int) -> StreamRow:
    return StreamRow(stream_id, "w1", "events", {"stream_id": stream_id})


def payloads(found: list[tuple[int, list[StreamRow]]] | None) -> list[tuple[int, list[int]]]:
    assert found is not None
    return [(stream_id, [r.stream_id for r in rows]) for stream_id, rows in found]


def test_nothing_is_kept_before_it_is_opened() -> None:
    outbox = Outbox()
    outbox.written([1, 2], [row(1), row(2)])
    outbox.unknown(2, 5)
    assert not outbox.is_open
    assert outbox.known(0, 10) is None  # read back: the outbox saw none of it


def test_it_keeps_rows_by_id_until_they_are_sent() -> None:
    outbox = Outbox()
    outbox.open()
    outbox.written([2, 3], [row(2), row(3)])
    outbox.written([5], None)  # rows not known
    assert payloads(outbox.known(1, 3)) == [(2, [2]), (3, [3])]
    assert outbox.known(1, 5) is None  # 5 must be read back
    outbox.sent_upto(3)
    assert outbox.known(1, 3) == []
    outbox.sent_upto(5)
    assert outbox.known(3, 5) == []


def test_a_backwards_streams_rows_are_keyed_internally() -> None:
    outbox = Outbox(sign=-1)
    outbox.open()
    outbox.written([4], [row(-4)])  # the row carries the signed ID
    assert payloads(outbox.known(3, 4)) == [(4, [-4])]


def test_a_range_a_lost_write_may_hold_is_always_read_back() -> None:
    outbox = Outbox()
    outbox.open()
    outbox.written([2], [row(2)])
    outbox.unknown(2, 4)
    outbox.written([5], [row(5)])
    assert payloads(outbox.known(0, 2)) == [(2, [2])]
    assert outbox.known(0, 5) is None
    assert payloads(outbox.known(4, 5)) == [(5, [5])]


async def test_a_post_schedules_the_reader_once_and_never_runs_it_inside_the_post() -> None:
    runs: list[list[tuple[str, int]]] = []
    outbox = Outbox()
    outbox.open(lambda: runs.append(outbox.take_fences()))
    outbox.moved()
    outbox.fenced("w2", 7)
    outbox.moved()
    assert runs == []  # not inside the writer's call
    await asyncio.sleep(0)
    assert runs == [[("w2", 7)]]  # once for all three posts
    await asyncio.sleep(0)
    assert runs == [[("w2", 7)]]
    outbox.moved()
    await asyncio.sleep(0)
    assert runs == [[("w2", 7)], []]


POSTS = st.lists(st.sampled_from(["moved", "fenced", "yield"]), max_size=40)


@settings(max_examples=200, deadline=None)
@given(POSTS)
def test_every_post_that_is_due_reaches_the_reader_and_no_fence_is_lost(posts: list[str]) -> None:
    """Whatever the posts and wherever the loop runs between them: after the last, the
    reader has run since every post, it ran at most once per loop pass, and it got each
    fence once, in order."""

    async def run() -> None:
        outbox = Outbox()
        runs: list[int] = []  # the post count when the reader ran
        fences: list[int] = []
        posted = 0
        last_due = -1

        def reader() -> None:
            runs.append(posted)
            fences.extend(position for _, position in outbox.take_fences())

        outbox.open(reader)
        for n, post in enumerate(posts):
            posted = n
            if post == "yield":
                before = len(runs)
                await asyncio.sleep(0)
                assert len(runs) - before <= 1
                continue
            if post == "moved":
                outbox.moved()
                last_due = n
            else:
                outbox.fenced("w2", n)
                last_due = n
        posted = len(posts)
        await asyncio.sleep(0)
        if last_due >= 0:
            assert runs
            assert runs[-1] > last_due  # it ran after the last due post, not inside it
        else:
            assert runs == []
        assert fences == [n for n, post in enumerate(posts) if post == "fenced"]

    asyncio.run(run())


async def test_a_fence_posted_before_there_was_a_reader_reaches_it() -> None:
    """Replication opens the outbox at start-up (so no write is missed) before its
    sender exists; a fence found meanwhile waits for the reader, then reaches it."""
    outbox = Outbox()
    outbox.open()
    outbox.fenced("w2", 5)
    runs: list[list[tuple[str, int]]] = []
    outbox.open(lambda: runs.append(outbox.take_fences()))
    await asyncio.sleep(0)
    assert runs == [[("w2", 5)]]
