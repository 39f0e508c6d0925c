"""`EsPipeline`, a Dagster component: es_pipeline in a `dg` project, configured in a `defs.yaml`.

    # <project>/defs/lake/defs.yaml
    type: es_pipeline.component.EsPipeline
    attributes:
      domain: [shop.domain, billing.domain]   # the modules of the team's reducers (ES_PIPELINE_DOMAIN)
      warehouse: s3://lake/shop               # ES_PIPELINE_WAREHOUSE
      slice_ranges: 8                         # ES_PIPELINE_SLICE_RANGES
      source: emmett                          # ES_PIPELINE_SOURCE

It builds what `es_pipeline.location.build_definitions` builds, over the settings of the environment with
these attributes in place of their variables, checked the same way. The store's DSN is never an attribute: a
password does not belong in a YAML file; it stays in ES_PIPELINE_PG_DSN (or a passfile or service it names).
"""

from __future__ import annotations

import os

import dagster as dg

from es_pipeline.location import build_definitions
from es_pipeline.settings import Settings


class EsPipeline(dg.Component, dg.Model, dg.Resolvable):
    """Every es_pipeline asset, check, sensor and schedule over one event store and one lake, folding with the
    team's domain (docs/domain.md)."""

    domain: list[str] = []
    warehouse: str | None = None
    slice_ranges: int | None = None
    source: str | None = None
    tail_seconds: int | None = None

    def settings(self) -> Settings:
        """The environment's settings with the attributes given in their variables' place."""
        given = {"ES_PIPELINE_DOMAIN": ",".join(self.domain) if self.domain else None,
                 "ES_PIPELINE_WAREHOUSE": self.warehouse, "ES_PIPELINE_SOURCE": self.source,
                 "ES_PIPELINE_SLICE_RANGES": None if self.slice_ranges is None else str(self.slice_ranges),
                 "ES_PIPELINE_TAIL_SECONDS": None if self.tail_seconds is None else str(self.tail_seconds)}
        return Settings.from_env({**os.environ, **{k: v for k, v in given.items() if v is not None}})

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return build_definitions(self.settings())
