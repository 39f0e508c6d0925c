"""Alerts from the code location itself: the run-failure sensor."""
