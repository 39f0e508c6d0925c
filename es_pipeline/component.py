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
import textwrap
from pathlib import Path
from typing import Annotated, Any

import dagster as dg
from pydantic import BeforeValidator, Field, create_model

from es_pipeline.health.doctor import instance_gaps
from es_pipeline.location import build_definitions
from es_pipeline.settings import (
    ATTRIBUTES,
    PROJECT_ROOT,
    Modules,
    OneOf,
    Setting,
    Settings,
    Whole,
    from_component,
)

log = logging.getLogger("es_pipeline")

HEAD = """\
# es_pipeline: an event store in PostgreSQL, extracted exactly once into Delta tables, with projections.
# The whole path: docs/quickstart.md (in the es_pipeline package: es_pipeline/docs/quickstart.md).
# Each attribute stands for a variable of the environment (ES_PIPELINE_*); set here, it wins. `es-pipeline config`
# shows every setting and where it came from. Values may read the environment: "{{{{ env.LAKE_URI }}}}".
# The store's connection string is never an attribute (no password in YAML): export ES_PIPELINE_PG_DSN.
type: {type_name}

attributes:
"""


def _accepts(setting: Setting) -> str:
    kind = setting.kind
    if isinstance(kind, Whole):
        return f" ({kind.lo}-{kind.hi})"
    return f" ({', '.join(kind.allowed)})" if isinstance(kind, OneOf) else ""


def _default_value(setting: Setting) -> str:
    return "[]" if isinstance(setting.kind, Modules) else setting.shown_default().strip("`")


def _braced(text: str) -> str:
    """`text` as it stays through the template's `str.format` (the type's name is filled in when scaffolded)."""
    return text.replace("{", "{{").replace("}", "}}")


def _blank_is_unset(value: Any) -> Any:
    """An attribute given as "" (e.g. a template of an unset variable) is unset, as the command line takes it; a
    mode's word is read trimmed."""
    return (value.strip() or None) if isinstance(value, str) else value


def template() -> str:
    """What `dg scaffold defs es_pipeline.component.EsPipeline <name>` writes: every attribute (es_pipeline/settings.py
    `DECLARED`), described, those the template sets at their value, the others commented out at their defaults."""
    lines = [HEAD]
    for name, setting in ATTRIBUTES.items():
        said = f"{setting.brief.rstrip('.')}{_accepts(setting)}. {setting.variable}."
        lines += [f"  # {_braced(line)}\n" for line in textwrap.wrap(said, 112)]
        lines.append(f"  {name}: {setting.scaffold}\n" if setting.scaffold is not None
                     else f"  # {name}: {_default_value(setting)}\n")
    return "".join(lines)


TEMPLATE = template()


def _fields() -> dict[str, Any]:
    """The component's attributes as pydantic fields, one per declared attribute: its type (a `Literal` for a mode;
    a list for the domain's modules), unset by default (the variable's value, or its default, then holds)."""
    fields: dict[str, Any] = {}
    for name, setting in ATTRIBUTES.items():
        description = (f"{setting.brief.rstrip('.')}{_accepts(setting)}. {setting.variable}; default "
                       f"{setting.shown_default().replace('`', '')}.")
        if isinstance(setting.kind, Modules):
            fields[name] = (setting.kind.annotation, Field(default=[], description=description))
        else:
            annotation: Any = Annotated[setting.kind.annotation | None, BeforeValidator(_blank_is_unset)]  # type: ignore[name-defined]
            fields[name] = (annotation, Field(default=None, description=description))
    return fields


Attributes = create_model("Attributes", __base__=dg.Model, **_fields())


class EsPipelineScaffolder(dg.Scaffolder):
    """Writes the commented `defs.yaml` above."""

    def scaffold(self, request: dg.ScaffoldRequest) -> None:
        target = request.target_path if request.append else request.target_path / "defs.yaml"
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a" if request.append else "w", encoding="utf-8") as out:
            out.write(("---\n" if request.append else "") + TEMPLATE.format(type_name=request.type_name))


@dg.scaffold_with(EsPipelineScaffolder)
class EsPipeline(dg.Component, Attributes, dg.Resolvable):  # type: ignore[misc, valid-type]
    """Every es_pipeline asset, check, sensor and schedule over one event store and one lake, folding with the
    team's domain. Each attribute stands for an ES_PIPELINE_* variable and wins over it (the attributes are declared
    with the settings, es_pipeline/settings.py); the store's DSN stays in ES_PIPELINE_PG_DSN. docs/quickstart.md
    (es_pipeline/docs/ in the package)."""

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
