"""The shop's own Dagster code location: its defs folder (shop/defs/), where the `EsPipeline` component
(es_pipeline/component.py) is configured in `lake/defs.yaml` with the shop's domains.

    dg dev                  # in examples/shop
    dagster dev -m shop.definitions

Without `dg`, the same location in Python: `es_pipeline.location.build_definitions(domain=...)`.
"""

from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
