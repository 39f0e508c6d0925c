"""The `snapshots` asset and the schedule that takes them."""
