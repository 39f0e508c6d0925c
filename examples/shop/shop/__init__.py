"""The shop: an example of a team's own package on es_pipeline (its domain, its code location)."""
