"""The Delta lake: one room per table (stream_state, aggregate and projections, snapshots) over the fold, the
change feed, the table definition and the Delta primitives (tables); the Spark session; catalog; maintenance."""
