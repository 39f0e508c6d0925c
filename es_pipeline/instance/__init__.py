"""Dagster instance plugins that `dagster.yaml` names (the warm run launcher). Not part of the code location."""
