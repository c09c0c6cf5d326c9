"""Row codecs: a row read from the database looks like the same row sent as JSON."""

from __future__ import annotations

import datetime
import decimal
import json
import uuid

from plait.replication.rows import DictRows, jsonable
from plait.storage.stream_tables import StreamRow


def test_database_values_become_json_values() -> None:
    moment = datetime.datetime(2026, 11, 21, 12, 30, tzinfo=datetime.UTC)
    data = {
        "stream_id": 5,
        "body": "x",
        "flag": True,
        "none": None,
        "at": moment,
        "day": moment.date(),
        "amount": decimal.Decimal("1.50"),
        "key": uuid.UUID(int=1),
        "blob": b"\x00\xff",
        "ratio": 0.5,
        "nan": float("nan"),
        "doc": {"a": [1, moment]},
    }
    row = DictRows().from_db(StreamRow(5, "w1", "events", data))
    assert row == {
        "stream_id": 5,
        "body": "x",
        "flag": True,
        "none": None,
        "at": "2026-11-21T12:30:00+00:00",
        "day": "2026-11-21",
        "amount": "1.50",
        "key": "00000000-0000-0000-0000-000000000001",
        "blob": "AP8=",
        "ratio": 0.5,
        "nan": None,
        "doc": {"a": [1, "2026-11-21T12:30:00+00:00"]},
    }
    assert json.loads(json.dumps(row, allow_nan=False)) == row  # survives the wire as is


def test_rows_of_json_scalars_pass_through_unchanged() -> None:
    data = {"stream_id": 1, "instance_name": "w1", "body": None, "ok": False}
    assert DictRows().from_db(StreamRow(1, "w1", "events", data)) is data
    assert jsonable(datetime.time(1, 2)) == "01:02:00"


def test_rows_built_from_tuples_equal_rows_built_from_stream_rows() -> None:
    moment = datetime.datetime(2026, 11, 21, tzinfo=datetime.UTC)
    codec = DictRows()
    plain = codec.row_maker("events", [("stream_id", 20), ("body", 25), ("doc", 3802)])
    assert plain([(7, "x", {"a": 1})]) == [{"stream_id": 7, "body": "x", "doc": {"a": 1}}]
    mixed_columns = [("stream_id", 20), ("at", 1184), ("amount", 1700)]
    mixed = codec.row_maker("events", mixed_columns)
    values = (7, moment, decimal.Decimal("2.5"))
    expected = codec.from_db(
        StreamRow(7, "w1", "events", dict(zip(["stream_id", "at", "amount"], values, strict=True)))
    )
    assert mixed([values, values]) == [expected, expected]
    assert expected == {"stream_id": 7, "at": "2026-11-21T00:00:00+00:00", "amount": "2.5"}
    odd = codec.row_maker("events", [('it\'s "quoted"', 25), ("a\nb", 1184)])
    assert odd([("x", moment)]) == [{'it\'s "quoted"': "x", "a\nb": "2026-11-21T00:00:00+00:00"}]
