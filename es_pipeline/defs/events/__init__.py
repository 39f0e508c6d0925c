"""The `events` domain: the slice-range partitions, the asset, its sensor, its table-wide checks."""
