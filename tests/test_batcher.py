"""Group commit (`Batcher`, issue 22) on a real PostgreSQL: concurrent single-row inserts
of one statement become one transaction; each caller gets its own IDs, or its own
error; a batch whose outcome is unknown is never run again."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

import pace
from plait import Batcher, ConfigError, Database, StateError
from stream_helpers import create_generator, create_table

ROW = (
    "INSERT INTO events (stream_id, instance_name, payload) VALUES ({id}, 'w', %s)"
    " RETURNING stream_id"
)


async def transactions_of(db: Database) -> int:
    """How many transactions wrote the rows of `events` (distinct xmin)."""
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT count(DISTINCT xmin::text) FROM events")).fetchone()
    assert row is not None
    return int(row[0])


async def payloads_by_id(db: Database) -> dict[int, str]:
    async with db.connection() as conn:
        cur = await conn.execute("SELECT stream_id, payload FROM events")
        return {int(i): str(p) for i, p in await cur.fetchall()}


async def test_concurrent_inserts_share_one_transaction_and_each_gets_its_own_ids(
    db: Database,
) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    async with Batcher(gen, linger=0.5, max_batch=100) as batcher:
        got = await asyncio.gather(*(batcher.insert(ROW, (f"p{n}",)) for n in range(100)))
    assert all(len(ids) == 1 for ids in got)
    ids = [ids[0] for ids in got]
    assert len(set(ids)) == 100
    stored = await payloads_by_id(db)
    assert {i: stored[i] for i in ids} == {ids[n]: f"p{n}" for n in range(100)}  # own row
    assert len(stored) == 100
    assert await transactions_of(db) == 1  # one commit for the hundred
    assert gen.get_current_token() == max(ids)  # every ID completed


async def test_a_full_batch_leaves_at_once_and_the_rest_after_the_linger(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    async with Batcher(gen, linger=30.0, max_batch=10) as batcher:
        # 20 fill two batches, which leave without waiting the 30 s linger.
        got = await pace.wait(
            asyncio.gather(*(batcher.insert(ROW, (str(n),)) for n in range(20))),
            30,
            "two full batches",
        )
        assert len({ids[0] for ids in got}) == 20
        assert await transactions_of(db) == 2
        late = asyncio.ensure_future(batcher.insert(ROW, ("late",)))
        await asyncio.sleep(0.1)
        assert not late.done()  # one call waits for the linger, or for aclose
    assert len(late.result()) == 1  # closing sent it
    assert await transactions_of(db) == 3


async def test_a_bad_row_fails_only_its_own_caller(db: Database) -> None:
    await create_table(db)
    async with db.connection() as conn:
        await conn.execute("ALTER TABLE events ADD CHECK (payload <> 'bad')")
    gen = await create_generator(db, ["w"], "w")
    async with Batcher(gen, linger=0.2) as batcher:
        results = await asyncio.gather(
            *(batcher.insert(ROW, (p,)) for p in ["a", "b", "bad", "c"]), return_exceptions=True
        )
    assert isinstance(results[2], psycopg.errors.CheckViolation)
    good = [r for n, r in enumerate(results) if n != 2]
    assert all(isinstance(r, list) and len(r) == 1 for r in good)
    assert sorted((await payloads_by_id(db)).values()) == ["a", "b", "c"]
    # The refused batch's IDs completed too (after a WAL flush): nothing holds the
    # position below the good rows.
    top = max(r[0] for r in good if isinstance(r, list))
    await pace.until(lambda: gen.get_current_token() >= top, 10, "the position to pass the rows")


async def terminate_once(db: Database, query_like: str) -> None:
    """Terminate the first server process found running a statement like `query_like`."""
    async with db.connection() as conn:
        while True:
            cur = await conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE query LIKE %s AND pid <> pg_backend_pid()",
                (query_like,),
            )
            pids = [row[0] for row in await cur.fetchall()]
            if pids:
                await conn.execute("SELECT pg_terminate_backend(%s)", (pids[0],))
                return
            await asyncio.sleep(0.02)


async def test_a_batch_that_lost_its_connection_before_commit_runs_again_row_by_row(
    db: Database,
) -> None:
    """Cut mid-statement, the batch never committed: each row runs again alone, and each
    is written once."""
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    slow = (
        "INSERT INTO events (stream_id, instance_name, payload)"
        " SELECT {id}, 'w', %s FROM pg_sleep(0.3) RETURNING stream_id"
    )
    killer = asyncio.ensure_future(terminate_once(db, "%pg_sleep(0.3)%"))
    async with Batcher(gen, linger=0.05) as batcher:
        results = await asyncio.gather(
            *(batcher.insert(slow, (str(n),)) for n in range(4)), return_exceptions=True
        )
    await killer
    assert all(isinstance(r, list) and len(r) == 1 for r in results), results
    stored = await payloads_by_id(db)
    assert sorted(stored.values()) == ["0", "1", "2", "3"]  # each once
    assert {stored[r[0]] for r in results if isinstance(r, list)} == {"0", "1", "2", "3"}


async def test_a_batch_whose_commit_lost_its_answer_fails_every_caller_and_never_runs_again(
    db: Database,
) -> None:
    """Cut during COMMIT, the batch may have committed: every caller gets the failure,
    as a lone insert would, and no row runs again (it could be written twice)."""
    await create_table(db)
    async with db.connection() as conn:
        await conn.execute(
            "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN PERFORM pg_sleep(0.5); RETURN NULL; END $$;"
            " CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON events"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()"
        )
    gen = await create_generator(db, ["w"], "w")
    killer = asyncio.ensure_future(terminate_once(db, "COMMIT%"))
    async with Batcher(gen, linger=0.05) as batcher:
        results = await asyncio.gather(
            *(batcher.insert(ROW, (str(n),)) for n in range(4)), return_exceptions=True
        )
    await killer
    assert all(isinstance(r, Exception) for r in results), results
    assert len({id(r) for r in results}) == 1  # the one failure, told to each caller
    assert await payloads_by_id(db) == {}  # the cut COMMIT rolled back; nothing ran again


async def test_misuse_is_refused_in_plain_words(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    with pytest.raises(ConfigError, match="linger"):
        Batcher(gen, linger=-1)
    with pytest.raises(ConfigError, match="max_batch"):
        Batcher(gen, max_batch=0)
    batcher = Batcher(gen, linger=0.2)
    ok = asyncio.ensure_future(batcher.insert(ROW, ("fine",)))
    await asyncio.sleep(0)  # it joins the gathering
    with pytest.raises(ConfigError, match=r"write \{id\}"):  # alone, at once
        await batcher.insert("INSERT INTO events VALUES (1, 'w')")
    await batcher.aclose()
    assert len(await ok) == 1
    with pytest.raises(StateError, match="closed"):
        await batcher.insert(ROW, ("after",))


async def test_whole_rows_of_a_batch_reach_the_outbox(db: Database) -> None:
    """With replication, rows a batch returned whole (RETURNING *) go out from the
    outbox without being read back."""
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    outbox = gen.open_outbox()
    whole = ROW.replace("RETURNING stream_id", "RETURNING *")
    async with Batcher(gen, linger=0.2) as batcher:
        got = await asyncio.gather(*(batcher.insert(whole, (p,)) for p in "xyz"))
    top = max(ids[0] for ids in got)
    known = outbox.known(1, top)
    assert known is not None
    assert sorted(r.data["payload"] for _, rows in known for r in rows) == ["x", "y", "z"]


async def test_a_statement_without_parameters_is_taken_as_insert_takes_it(db: Database) -> None:
    """No parameters: a literal % is no placeholder, in a batch as in a lone insert."""
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    literal = (
        "INSERT INTO events (stream_id, instance_name, payload) VALUES ({id}, 'w', '100%')"
        " RETURNING stream_id"
    )
    async with Batcher(gen, linger=0.2) as batcher:
        got = await asyncio.gather(*(batcher.insert(literal) for _ in range(3)))
    assert len({ids[0] for ids in got}) == 3
    assert await transactions_of(db) == 1
    assert set((await payloads_by_id(db)).values()) == {"100%"}
