"""dlt, the tool a user would otherwise pick: `sql_database` incremental load into a Delta table.

dlt's own defaults (SQLAlchemy backend, incremental cursor on `global_position`, the filesystem
destination with `table_format="delta"`), reading the same columns as es_pipeline through a view
(dlt's reflection knows neither xid8 nor what es_pipeline casts jsonb to). Its cursor is a
sequence, which can lose events (docs/architecture.md); it is measured here for speed only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psycopg

from bench.common import SCHEMA, Timing
from es_pipeline.extraction.reader import EVENT_COLUMNS
from es_pipeline.source.mapping import native
from es_pipeline.store.conninfo import parse

VIEW = "bench_dlt_events"


def dlt_delta(dsn: str, work: Path) -> Timing:
    import dlt
    from dlt.sources.credentials import ConnectionStringCredentials
    from dlt.sources.sql_database import sql_table

    os.environ.setdefault("RUNTIME__DLTHUB_TELEMETRY", "false")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE OR REPLACE VIEW {SCHEMA}.{VIEW} AS SELECT {EVENT_COLUMNS} "
                     f"FROM {native(SCHEMA).relation()} e")  # the columns es_pipeline reads, as it reads them
    p = parse(dsn)  # the benchmark's own database: host, port, user and dbname, no password
    url = f"postgresql+psycopg2://{p['user']}@{p['host']}:{p['port']}/{p['dbname']}"
    url += f"?passfile={p['passfile']}" if p.get("passfile") else ""  # the local server's password file
    table = sql_table(
        credentials=ConnectionStringCredentials(url), schema=SCHEMA, table=VIEW,
        incremental=dlt.sources.incremental("global_position"),
    )
    pipeline = dlt.pipeline(
        pipeline_name="bench_dlt", pipelines_dir=str(work / "dlt_pipelines"),
        destination=dlt.destinations.filesystem(bucket_url=(work / "dlt_lake").as_uri()), dataset_name="dlt",
    )
    t0 = time.perf_counter()
    pipeline.run(table, table_format="delta")
    seconds = time.perf_counter() - t0
    from deltalake import DeltaTable

    dt = DeltaTable(str(work / "dlt_lake" / "dlt" / VIEW))
    rows = int(dt.to_pyarrow_dataset().count_rows())
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP VIEW {SCHEMA}.{VIEW}")
    return Timing("dlt sql_database (incremental on global_position) → Delta", rows, seconds,
                  {"backend": "sqlalchemy (dlt's default)"})
