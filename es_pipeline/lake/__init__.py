"""The Delta lake: tables, the Spark session, reducers, stream_state, projections, snapshots, catalog, maintenance."""
