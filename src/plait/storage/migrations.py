"""plait's own schema, as numbered migrations applied in order, once each.

Append new migrations at the end; never edit one that has shipped. `Database.migrate`
applies the missing ones under an advisory lock, so processes starting together do not
race each other.
"""

from __future__ import annotations

MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (
        1,
        "stream positions, instance map and stream specs",
        """
        CREATE TABLE IF NOT EXISTS stream_positions (
            stream_name TEXT NOT NULL,
            instance_name TEXT NOT NULL,
            stream_id BIGINT NOT NULL,
            CONSTRAINT stream_positions_uniq UNIQUE (stream_name, instance_name)
        );
        CREATE TABLE IF NOT EXISTS instance_map (
            instance_id SERIAL PRIMARY KEY,
            instance_name TEXT NOT NULL UNIQUE
        );
        CREATE TABLE IF NOT EXISTS plait_streams (
            stream_name TEXT PRIMARY KEY,
            sequence_name TEXT NOT NULL,
            backwards BOOLEAN NOT NULL,
            writers JSONB NOT NULL,
            tables JSONB NOT NULL,
            updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
        );
        """,
    ),
    (
        2,
        "cache invalidation stream: table and sequence",
        # The `caches` stream (SPEC R-CA-1): any writer, so no position rows. The
        # sequence hands out ID 1 here, so the first real ID is 2 (R-ST-1). The primary
        # key serves the start-up MAX(stream_id) and the cleanup's oldest-first batches.
        """
        CREATE TABLE IF NOT EXISTS cache_invalidations (
            stream_id BIGINT PRIMARY KEY,
            instance_name TEXT NOT NULL,
            cache_name TEXT NOT NULL,
            keys JSONB,
            invalidation_ts TIMESTAMPTZ NOT NULL DEFAULT statement_timestamp()
        );
        CREATE INDEX IF NOT EXISTS cache_invalidations_instance_id
            ON cache_invalidations (instance_name, stream_id);
        CREATE SEQUENCE IF NOT EXISTS cache_invalidations_seq;
        SELECT nextval('cache_invalidations_seq');
        """,
    ),
    (
        3,
        "when each position row last moved",
        # `plait status`: a writer whose row stopped moving while others went ahead holds
        # back every linear reader. Existing rows count as moved now.
        """
        ALTER TABLE stream_positions
            ADD COLUMN IF NOT EXISTS updated_at TIMESTAMPTZ NOT NULL DEFAULT now();
        """,
    ),
    (
        4,
        "writer incarnations, for fencing crashed writers",
        # A writer registers the epoch its connections carry in application_name before
        # its first allocation; a fence moves a dead incarnation's row and stamps
        # fenced_at, after which that incarnation may open no new connection. Rows
        # without an epoch (older writers, shared pools) are never fenced.
        """
        ALTER TABLE stream_positions
            ADD COLUMN IF NOT EXISTS epoch BIGINT,
            ADD COLUMN IF NOT EXISTS fenced_at TIMESTAMPTZ;
        """,
    ),
    (
        5,
        "a uid per stream, which Spark offsets carry",
        # A checkpoint of one stream reused for another, or for the same name in
        # another database, is then refused by name (plait.core.offsets). Random per
        # row, existing rows included; kept by failovers, upgrades and restores.
        """
        ALTER TABLE plait_streams
            ADD COLUMN IF NOT EXISTS stream_uid UUID NOT NULL DEFAULT gen_random_uuid();
        """,
    ),
)

LATEST = MIGRATIONS[-1][0]

# Any 64-bit number unlikely to clash with an application's own advisory locks.
MIGRATION_LOCK = 0x706C616974_01  # "plait", 1
