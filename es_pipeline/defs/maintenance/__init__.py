"""Jobs and schedules that keep the lake healthy: Delta compaction and vacuum, the table-wide checks."""
