"""Reading the lake: `es-pipeline sql` over DuckDB or Spark (`query`), every table in Spark's catalog
(`catalog`), and how far behind `events` each table is (`behind`)."""
