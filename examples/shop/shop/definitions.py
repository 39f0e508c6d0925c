"""The shop's own Dagster code location: es_pipeline's assets, folding with the shop's domain.

    dagster dev -m shop.definitions

Where (store, lake, Spark) comes from the environment, as for es_pipeline's own location (README, "Settings").
"""

from es_pipeline.location import build_definitions
from shop.domain import domain

defs = build_definitions(domain=domain)
