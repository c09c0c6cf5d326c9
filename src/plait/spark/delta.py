"""The Delta Lake export: the executors write a batch's Parquet files, the driver
commits them to the Delta log in one commit that also records the batch id, so a
batch Spark replays after a crash is skipped (SPEC §8).

Nothing proportional to the batch passes through the driver: each task writes the
rows it read (one file per partition value it holds) and hands back one small row per
file (its path, size, partition values and row count), and the driver commits those
as Delta "add" actions with the `deltalake` package (delta-rs). A crash after the
files are written and before the commit leaves files no commit names: readers never
see them, and `DeltaTable.vacuum(dry_run=False, full=True)` removes them once they are
older than the table's retention (a week by default). The executors need the table's
location reachable as the driver has it: a local path on one machine or a shared
file system, or a URI pyarrow's file systems open (s3://, gs://, hdfs://).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from plait.errors import ConfigError

# What each task hands the driver per file it wrote: (name, Spark type, Arrow type).
ADDED_FIELDS = (
    ("path", "string", "string"),
    ("size", "long", "int64"),
    ("partition_values", "string", "string"),
    ("rows", "long", "int64"),
)
ADDED = ", ".join(f"{name} {spark}" for name, spark, _ in ADDED_FIELDS)
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # Hive's and Spark's folder name for NULL


class DeltaBatches:
    """`foreachBatch` into a Delta table: files from the executors, one commit per batch
    from the driver recording the batch id (an application transaction of the query).

    The transaction is keyed by the query's id, which Spark keeps in the checkpoint for
    every run from it, not by how the checkpoint's path was spelt: the same checkpoint
    given once relative and once absolute wrote a replayed batch twice, and a checkpoint
    deleted and made again at the same path would skip the new query's first batches.
    The id comes from the running query (a classic session), else from the checkpoint's
    `metadata` file (Spark Connect, where the batch runs in the server's Python); when
    neither can be read, the export stops rather than guess a key."""

    def __init__(self, path: str, checkpoint: str, partitions: list[str]) -> None:
        self.path = path
        self.checkpoint = checkpoint
        self.partitions = partitions
        self._app_id: str | None = None

    def app_id(self, frame: Any = None) -> str:
        if self._app_id is None:
            query_id = running_query_id(frame) or checkpoint_query_id(self.checkpoint)
            if query_id is None:
                raise ConfigError(
                    f"the Delta export cannot read its query's id from the checkpoint "
                    f"{self.checkpoint!r} (its 'metadata' file), which keys the batches it "
                    "wrote: give the checkpoint as a full URI (hdfs://..., s3://...) when it "
                    "is not on this machine's file system"
                )
            self._app_id = f"plait-export:{query_id}"
        return self._app_id

    def done_upto(self, frame: Any = None) -> int:
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            version = DeltaTable(self.path).transaction_version(self.app_id(frame))
        except TableNotFoundError:
            return -1
        return -1 if version is None else int(version)

    def __call__(self, frame: Any, batch_id: int) -> None:
        from deltalake import CommitProperties, DeltaTable, Schema, Transaction
        from deltalake.exceptions import TableNotFoundError
        from deltalake.transaction import (
            AddAction,
            RemoveAction,
            create_table_with_add_actions,
        )
        from pyspark.sql.pandas.types import to_arrow_schema

        if batch_id <= self.done_upto(frame):
            return  # committed before a crash: Spark replays it, Delta has it
        # Absolute here: an executor resolves a relative path from its own folder.
        location = self.path if _SCHEME.match(self.path) else os.path.abspath(self.path)
        writer = FileWriter(location, self.partitions, batch_id)
        files = frame.mapInArrow(writer, ADDED).collect()  # a row per file, not per row
        now = int(time.time() * 1000)
        added = [
            AddAction(
                f.path,
                f.size,
                json.loads(f.partition_values),
                now,
                True,
                json.dumps({"numRecords": f.rows}),
            )
            for f in files
        ]
        commit = CommitProperties(app_transactions=[Transaction(self.app_id(frame), batch_id, now)])
        schema = to_arrow_schema(frame.schema, timezone="UTC")
        try:
            table = DeltaTable(self.path)
        except TableNotFoundError:
            create_table_with_add_actions(
                self.path,
                Schema.from_arrow(schema),
                added,
                mode="append",
                partition_by=self.partitions or None,
                commit_properties=commit,
            )
            return
        actions: list[AddAction | RemoveAction] = [*added]
        table.create_write_transaction(
            actions,
            mode="append",
            schema=schema,
            partition_by=self.partitions or None,
            commit_properties=commit,
        )


class FileWriter:
    """What each task runs (`mapInArrow`): its rows into Parquet files under the table,
    one per partition value, named so that no two tasks or tries share one; yields a
    row of `ADDED` per file."""

    def __init__(self, table: str, partitions: list[str], batch_id: int) -> None:
        self.table = table
        self.partitions = partitions
        self.batch_id = batch_id

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        fs, root = _filesystem(self.table)
        open_files: dict[tuple[str | None, ...], tuple[str, Any, list[int]]] = {}
        try:
            for batch in batches:
                for key, part in self._split(batch):
                    # Delta keeps partition values in the log, not in the files.
                    data = part.drop_columns(self.partitions) if self.partitions else part
                    if key not in open_files:
                        relative = self._file_name(key)
                        path = f"{root}/{relative}"
                        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
                        writer = pq.ParquetWriter(path, data.schema, filesystem=fs)
                        open_files[key] = (relative, writer, [0])
                    _, writer, rows = open_files[key]
                    writer.write_table(pa.Table.from_batches([data]))
                    rows[0] += part.num_rows
        finally:
            for _, writer, _ in open_files.values():
                writer.close()
        if not open_files:
            return
        out: dict[str, list[Any]] = {"path": [], "size": [], "partition_values": [], "rows": []}
        for key, (relative, _, rows) in open_files.items():
            out["path"].append(relative)  # plain characters only: the same as a URI
            out["size"].append(fs.get_file_info(f"{root}/{relative}").size)
            out["partition_values"].append(json.dumps(dict(zip(self.partitions, key, strict=True))))
            out["rows"].append(rows[0])
        schema = pa.schema([(name, getattr(pa, arrow)()) for name, _, arrow in ADDED_FIELDS])
        yield pa.RecordBatch.from_pydict(out, schema=schema)

    def _split(self, batch: Any) -> Iterator[tuple[tuple[str | None, ...], Any]]:
        """`batch`'s rows by partition value (as Delta writes them: text)."""
        if batch.num_rows == 0:
            return
        if not self.partitions:
            yield (), batch
            return
        keys = list(
            zip(
                *(map(partition_text, batch.column(name).to_pylist()) for name in self.partitions),
                strict=True,
            )
        )
        rows: dict[tuple[str | None, ...], list[int]] = {}
        for index, key in enumerate(keys):
            rows.setdefault(key, []).append(index)
        for key, indices in rows.items():
            yield key, batch.take(indices)

    def _file_name(self, key: tuple[str | None, ...]) -> str:
        folders = [
            f"{_folder_text(name)}={_HIVE_NULL if value is None else _folder_text(value)}"
            for name, value in zip(self.partitions, key, strict=True)
        ]
        name = f"part-{self.batch_id:05d}-{uuid.uuid4()}.snappy.parquet"
        return "/".join([*folders, name])


def partition_text(value: Any) -> str | None:
    """A partition value as the Delta log holds it (text; None for NULL)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime.datetime):
        moment: datetime.datetime = value
        if moment.tzinfo is not None:  # a timestamp: Delta keeps it in UTC
            moment = moment.astimezone(datetime.UTC).replace(tzinfo=None)
        return moment.strftime("%Y-%m-%d %H:%M:%S.%f")
    if isinstance(value, datetime.date | Decimal | int | float):
        return str(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


_PLAIN = re.compile(r"[A-Za-z0-9._-]{1,100}")


def _folder_text(text: str) -> str:
    """`text` in a folder name: as it is when plain (dates, numbers, simple names), else a
    digest. The log keeps the values and the file paths: Delta readers take partition
    values from the log, never from folder names, and a path of plain characters is the
    same in the log (where paths are URIs) and on disk."""
    if _PLAIN.fullmatch(text) and text not in (".", ".."):
        return text
    return "x" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _filesystem(table: str) -> tuple[Any, str]:
    """pyarrow's file system for the table's location, and the table's root in it."""
    import pyarrow.fs

    if _SCHEME.match(table) is None:
        return pyarrow.fs.LocalFileSystem(), table.rstrip("/") or "/"
    fs, root = pyarrow.fs.FileSystem.from_uri(table)
    return fs, root.rstrip("/")


def running_query_id(frame: Any) -> str | None:
    """The id of the streaming query whose batch `frame` is, as Spark tells the thread
    that runs the batch (None outside one, or where the session cannot be asked)."""
    if frame is None:
        return None
    try:
        value = frame.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
    except Exception:  # Spark Connect has no SparkContext; nothing else to ask then
        return None
    return value if isinstance(value, str) and value else None


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")  # two letters at least: not C:


def _metadata_text(checkpoint: str) -> str:
    """The checkpoint's `metadata` file: local, file://, or any file system pyarrow opens."""
    if _SCHEME.match(checkpoint) is None:
        return (Path(checkpoint).absolute() / "metadata").read_text()
    parts = urlsplit(checkpoint)
    if parts.scheme.lower() == "file" and parts.netloc in ("", "localhost"):
        return (Path(unquote(parts.path)).absolute() / "metadata").read_text()
    fs, root = _filesystem(checkpoint)
    with fs.open_input_stream(f"{root}/metadata") as stream:
        return str(bytes(stream.read()).decode())


def checkpoint_query_id(checkpoint: str) -> str | None:
    """The id of the streaming query whose checkpoint this is (Spark writes it to the
    checkpoint's `metadata` when the query first starts and keeps it for every run);
    None where it cannot be read."""
    try:
        value = json.loads(_metadata_text(checkpoint).splitlines()[0])
    except (OSError, ValueError, IndexError):  # pyarrow's errors are OSErrors too
        return None
    query_id = value.get("id") if isinstance(value, dict) else None
    return query_id if isinstance(query_id, str) and query_id else None
