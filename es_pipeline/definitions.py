"""The code location, `es_pipeline.definitions:defs`: es_pipeline over the environment's settings, folding with
the domain ES_PIPELINE_DOMAIN names (none: every stream's row without state). A team's own code location
calls `es_pipeline.location.build_definitions` with its domain instead (examples/shop/shop/definitions.py).
"""

from es_pipeline.location import build_definitions

defs = build_definitions()
