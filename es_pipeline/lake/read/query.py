"""`es-pipeline sql`: SQL over every table of the lake by its name, answered by DuckDB (no JVM) or Spark SQL.

DuckDB is the default: it starts in milliseconds and reads Delta through its `delta` extension (delta-kernel-rs,
the same reader family as delta-rs), which comes from PyPI (`duckdb-ext-delta`, with `duckdb-ext-httpfs` for an
`s3://` lake) and is loaded from that package's folder, never downloaded. Each table of the lake is a view
`<name>` over `delta_scan('<its path>')`, so a query always reads the table's latest version. Spark SQL
(`--engine spark`, lake/read/catalog.py) is there for what DuckDB cannot do: time travel (`VERSION AS OF`),
`DESCRIBE HISTORY`, Spark's own functions. An S3 lake's keys go into a DuckDB secret held in memory only.

On both engines `state_as_of('<stream type>', <moment>)` is a table: each stream's state at that moment, from
its history table (lake/state/history.py), without the interval logic: DuckDB has it as a table macro, Spark SQL
has the call rewritten into the same subquery (lake/read/as_of.py). Times without a zone are UTC on both.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import pyarrow as pa

from es_pipeline.errors import QueryFailed
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.read import as_of

ENGINES = ("duckdb", "spark")  # es_pipeline/cli.py says them too, so as not to import this module to parse
FORMATS = ("table", "csv", "json")


@dataclass
class Answer:
    """A query's result as Arrow, with the tables it could name; `complete`: every row (not only the first ones)."""

    rows: pa.Table
    tables: list[str]
    complete: bool = True


def extension_directory() -> str:
    """Where the `duckdb-ext-*` wheels put their extension files (`<dir>/v<duckdb>/<platform>/<name>.duckdb_extension`)."""
    import duckdb_ext  # type: ignore[import-not-found]  # a namespace package of the duckdb-ext-* wheels

    return str(Path(next(iter(duckdb_ext.__path__))) / "extensions")


def duckdb_connection(warehouse: Location, query: str | None = None) -> tuple[Any, list[str]]:
    """A DuckDB connection with a view per Delta table of the lake (with `query`: per table it names, or all where
    it names none, as `SHOW TABLES` does); the lake's table names."""
    import duckdb

    con = duckdb.connect(config={"extension_directory": extension_directory(),
                                 "autoinstall_known_extensions": False, "autoload_known_extensions": False})
    con.execute("LOAD delta")
    if tables.is_uri(warehouse):
        _s3_secret(con)
    con.execute("SET TimeZone = 'UTC'")  # a moment written without a zone (TIMESTAMP '2026-10-31 23:59') is UTC
    listed = tables.table_names(warehouse, "")  # every Delta table under the warehouse, `events` first
    names = [n for n in tables.TABLES if n in listed] + [n for n in listed if n not in tables.TABLES]
    histories = query is not None and as_of.AS_OF in query.lower()
    named = [n for n in names if query is None or re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", query, re.IGNORECASE)
             or (histories and (n.endswith("_history") or n == "stream_state"))]
    for name in named or names:  # a view reads its table's log when made: a lake of 300 tables makes only those used
        path = tables.table_path(warehouse, name)
        quoted = path.replace("'", "''")
        # `state_as_of` reads stream_state's `quarantined`: NULL in a lake not updated since quarantine came.
        extra = ", CAST(NULL AS VARCHAR) AS quarantined" if name == "stream_state" and not tables.has_columns(
            path, ["quarantined"]) else ""
        con.execute(f'CREATE OR REPLACE VIEW "{name}" AS SELECT *{extra} FROM delta_scan(\'{quoted}\')')
    con.execute(as_of.DUCKDB_MACRO)
    return con, names


def _s3_secret(con: Any) -> None:
    """The S3 endpoint and keys of the AWS_* variables (what delta-rs and Spark read) as a DuckDB secret, in memory."""
    con.execute("LOAD httpfs")
    env = os.environ
    options = {"KEY_ID": env.get("AWS_ACCESS_KEY_ID"), "SECRET": env.get("AWS_SECRET_ACCESS_KEY"),
               "SESSION_TOKEN": env.get("AWS_SESSION_TOKEN"),
               "REGION": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"}
    endpoint = env.get("AWS_ENDPOINT_URL")
    if endpoint:
        parts = urlsplit(endpoint)
        options["ENDPOINT"] = parts.netloc or endpoint
        options["URL_STYLE"] = "path"
        options["USE_SSL"] = "false" if parts.scheme == "http" else "true"
    given = [(k, v) for k, v in options.items() if v]
    # Parameters are not taken by CREATE SECRET: the values are quoted here; the statement is never printed.
    body = ", ".join(f"{k} {v}" if k == "USE_SSL" else f"{k} '{str(v).replace(chr(39), chr(39) * 2)}'" for k, v in given)
    con.execute(f"CREATE OR REPLACE SECRET es_pipeline_lake (TYPE s3, {body})")


def run(warehouse: Location, query: str, *, engine: str = "duckdb", settings: Any = None,
        first: int | None = None) -> Answer:
    """`query` over the lake's tables by the engine named; Spark needs `settings` (its master, the lake's S3).
    `first`: read only so many rows (and whether there are more), not the whole result (`SELECT * FROM events`)."""
    if engine == "duckdb":
        import duckdb

        names: list[str] = []
        con = None
        try:
            con, names = duckdb_connection(warehouse, query)
            if first is None:
                return Answer(con.execute(query).fetch_arrow_table(), names)
            reader = con.execute(query).fetch_record_batch(max(first, 1) + 1)
            batches, held = [], 0
            for batch in reader:
                batches.append(batch)
                held += batch.num_rows
                if held > first:
                    break
            rows = pa.Table.from_batches(batches, schema=reader.schema)
            return Answer(rows.slice(0, first), names, complete=rows.num_rows <= first)
        except duckdb.Error as exc:
            raise QueryFailed("duckdb", _first_line(exc), names, warehouse) from None
        finally:
            if con is not None:
                con.close()
    if engine == "spark":
        from es_pipeline.lake.delta.tables import spark_errors
        from es_pipeline.lake.read.catalog import sql_over_lake

        try:
            frame, names = sql_over_lake(settings, query)
            if first is None:
                return Answer(frame.toArrow(), names)
            rows = frame.limit(first + 1).toArrow()
            return Answer(rows.slice(0, first), names, complete=rows.num_rows <= first)
        except spark_errors() as exc:
            raise QueryFailed("spark", _first_line(exc), []) from None
    raise ValueError(f"no engine {engine!r}: say one of {', '.join(ENGINES)}")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")


def write(rows: pa.Table, fmt: str, out: IO[str] = sys.stdout, *, limit: int | None = None,
          complete: bool = True) -> None:
    """`rows` as a table for a terminal (at most `limit` rows, and how many there were), CSV (NULL as an empty
    field) or JSON lines. `complete`: `rows` is the whole result (else its first rows)."""
    if fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")  # one newline per line, as the other formats write
        writer.writerow(rows.column_names)
        for row in rows.to_pylist():
            writer.writerow(["" if v is None else _text(v) for v in row.values()])
    elif fmt == "json":
        for row in rows.to_pylist():
            out.write(json.dumps(row, default=str, ensure_ascii=False) + "\n")
    elif fmt == "table":
        out.write(render(rows, limit=limit, complete=complete))
    else:
        raise ValueError(f"no output format {fmt!r}: say one of {', '.join(FORMATS)}")


def render(rows: pa.Table, *, limit: int | None = 50, width: int = 40, complete: bool = True) -> str:
    """A plain text table: a header, a rule, the first `limit` rows, each cell cut at `width` characters."""
    shown = rows.slice(0, limit) if limit is not None else rows
    cells = [[_cut(_text(v), width) for v in r.values()] for r in shown.to_pylist()]
    widths = [max([len(n), *(len(c[i]) for c in cells)]) for i, n in enumerate(rows.column_names)]
    numeric = [pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) for t in rows.schema.types]
    buf = io.StringIO()

    def line(values: list[str]) -> None:
        buf.write(" | ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True))
                  .rstrip() + "\n")

    line(rows.column_names)
    buf.write("-+-".join("-" * w for w in widths) + "\n")
    for c in cells:
        line(c)
    more = rows.num_rows - shown.num_rows
    if not complete:
        buf.write(f"(the first {shown.num_rows} rows; there are more: --limit to see more, --format csv for all)\n")
    else:
        buf.write(f"({rows.num_rows} row{'s' if rows.num_rows != 1 else ''}"
                  f"{f', the first {shown.num_rows} shown: --limit to see more' if more > 0 else ''})\n")
    return buf.getvalue()


def _text(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, dict | list):
        return json.dumps(value, default=str, ensure_ascii=False)
    return str(value)


def _cut(text: str, width: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"
