"""A DSN whose sessions work in one PostgreSQL schema (`--schema`, the demo's and the
checker's own schemas, the tests' per-test schemas): `-c search_path=...` added to the
DSN's `options`, which libpq sends at connect, so plait's tables and the streams'
tables are looked up there by every connection made from it (Spark's included)."""

from __future__ import annotations

import re

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from plait.errors import ConfigError

# A plain identifier: libpq splits `options` on spaces, and PostgreSQL folds case.
_NAME = re.compile(r"[a-z_][a-z0-9_$]{0,62}")


def in_schema(dsn: str, schema: str, what: str = "schema") -> str:
    """`dsn` with `schema` as its sessions' search_path (`what`: how the caller names
    the setting in an error, e.g. "--schema")."""
    if not _NAME.fullmatch(schema):
        raise ConfigError(
            f"{what} {schema!r} is not a plain schema name: use lower-case letters, digits "
            "and _ (at most 63), starting with a letter or _"
        )
    params = conninfo_to_dict(dsn)
    options = str(params.get("options") or "")
    params["options"] = f"{options} -c search_path={schema}".strip()
    return make_conninfo("", **params)
