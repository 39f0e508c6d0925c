"""`EsPipeline`, a Dagster component: es_pipeline in a `dg` project, configured in a `defs.yaml`.

    # <project>/src/<package>/defs/lake/defs.yaml (`dg scaffold defs es_pipeline.component.EsPipeline lake`)
    type: es_pipeline.component.EsPipeline
    attributes:
      domain: [shop.domain, billing.domain]   # the modules of the team's reducers (ES_PIPELINE_DOMAIN)
      warehouse: s3://lake/shop               # ES_PIPELINE_WAREHOUSE
      slice_ranges: 8                         # ES_PIPELINE_SLICE_RANGES
      source: emmett                          # ES_PIPELINE_SOURCE

It builds what `es_pipeline.location.build_definitions` builds, over the settings of the environment with
these attributes in place of their variables, checked the same way; an error names the attribute. The store's
DSN is never an attribute: a password does not belong in a YAML file; it stays in ES_PIPELINE_PG_DSN (or a
passfile or service it names). The `es-pipeline` command reads the same attributes (es_pipeline/project.py), so
the command line and the code location share one configuration. docs/quickstart.md is the whole path.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import dagster as dg
from pydantic import Field

from es_pipeline.health.doctor import instance_gaps
from es_pipeline.location import build_definitions
from es_pipeline.settings import PROJECT_ROOT, Settings, from_component

log = logging.getLogger("es_pipeline")

# What `dg scaffold defs es_pipeline.component.EsPipeline <name>` writes: every attribute, described, the optional
# ones commented out at their defaults.
TEMPLATE = """\
# es_pipeline: an event store in PostgreSQL, extracted exactly once into Delta tables, with projections.
# The whole path: docs/quickstart.md (in the es_pipeline package: es_pipeline/docs/quickstart.md).
# Each attribute stands for a variable of the environment (ES_PIPELINE_*); set here, it wins. `es-pipeline config`
# shows every setting and where it came from. Values may read the environment: "{{{{ env.LAKE_URI }}}}".
# The store's connection string is never an attribute (no password in YAML): export ES_PIPELINE_PG_DSN.
type: {type_name}

attributes:
  # The modules holding the team's Domain: reducers, upcasters, typed states, projections (docs/domain.md).
  domain: []
  # Where the Delta tables live: a folder (relative: to the project's root) or s3://bucket/prefix.
  warehouse: warehouse
  # Dagster partitions of `events`: the 1024 slices split into this many ranges (1-1024).
  # slice_ranges: 8
  # The event table read: es (es_pipeline's own es.events), es-tenants, emmett, pekko-r2dbc, pekko-jdbc, marten,
  # or a TOML mapping file (docs/sources.md).
  # source: es
  # How long a sensor-started `events` run follows the store, in seconds (0: one pass per run).
  # tail_seconds: 300
  # Where tables are built whole: auto (Spark past 1 GiB of `events`), spark, or local (never Spark).
  # engine: auto
  # A lake asset not materialized for this long is stale in Dagster (60-604800 seconds).
  # freshness_seconds: 120
"""


class EsPipelineScaffolder(dg.Scaffolder):
    """Writes the commented `defs.yaml` above."""

    def scaffold(self, request: dg.ScaffoldRequest) -> None:
        target = request.target_path if request.append else request.target_path / "defs.yaml"
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a" if request.append else "w", encoding="utf-8") as out:
            out.write(("---\n" if request.append else "") + TEMPLATE.format(type_name=request.type_name))


@dg.scaffold_with(EsPipelineScaffolder)
class EsPipeline(dg.Component, dg.Model, dg.Resolvable):
    """Every es_pipeline asset, check, sensor and schedule over one event store and one lake, folding with the
    team's domain. Each attribute stands for an ES_PIPELINE_* variable and wins over it; the store's DSN stays in
    ES_PIPELINE_PG_DSN. docs/quickstart.md (es_pipeline/docs/ in the package)."""

    domain: list[str] = Field(default=[], description=(
        "The modules holding the team's Domain (reducers, upcasters, typed states, projections), as imported: "
        "`my_project.domain`, or `module:attribute`. ES_PIPELINE_DOMAIN. Empty: no reducer, stateless rows."))
    warehouse: str | None = Field(default=None, description=(
        "Where the Delta tables live: a folder (relative: to the project's root) or s3://bucket/prefix. "
        "ES_PIPELINE_WAREHOUSE; default: <project>/warehouse."))
    slice_ranges: int | None = Field(default=None, description=(
        "How many Dagster partitions of `events` the 1024 slices are split into (1-1024). ES_PIPELINE_SLICE_RANGES; "
        "default 8."))
    source: str | None = Field(default=None, description=(
        "The event table read: es, es-tenants, emmett, pekko-r2dbc, pekko-jdbc, marten (optionally `:schema`) or a "
        "TOML mapping file. ES_PIPELINE_SOURCE; default es."))
    tail_seconds: int | None = Field(default=None, description=(
        "How long a sensor-started `events` run follows the store (0: one pass per run). ES_PIPELINE_TAIL_SECONDS; "
        "default 300."))
    engine: str | None = Field(default=None, description=(
        "Where tables are built whole: auto (Spark past 1 GiB of `events`), spark or local. ES_PIPELINE_ENGINE; "
        "default auto."))
    freshness_seconds: int | None = Field(default=None, description=(
        "A lake asset not materialized for this long is stale in Dagster (60-604800). "
        "ES_PIPELINE_FRESHNESS_SECONDS; default 120."))

    def settings(self, where: str = "defs.yaml", project_root: Path | None = None) -> Settings:
        """The environment's settings with the attributes given in their variables' place; a refused value is
        reported as the attribute of `where` (the component's defs.yaml)."""
        return from_component(self.model_dump(), where, project_root or PROJECT_ROOT)

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        where = _relative(context.path / "defs.yaml", context.project_root)
        settings = self.settings(where, context.project_root)
        warn_about_instance(os.environ.get("DAGSTER_HOME"))
        return build_definitions(settings)


def warn_about_instance(dagster_home: str | None) -> None:
    gaps = instance_gaps(dagster_home)
    if gaps:
        where = f"{dagster_home}/dagster.yaml" if dagster_home else "DAGSTER_HOME (unset: a temporary instance)"
        log.warning("es_pipeline: the Dagster instance (%s) lacks %s; `es-pipeline dagster-yaml` prints the settings "
                    "es_pipeline relies on (docs/quickstart.md, \"The Dagster instance\")", where, " and ".join(gaps))


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)
