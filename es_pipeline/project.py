"""The user's dg project, as the command line sees it: one configuration with the code location, and a first
materialization in one command.

`configuration()` reads the `EsPipeline` component's attributes from the project's `defs.yaml` (the one the code
location loads), so `es-pipeline status`, `sql`, `doctor` and the rest work on the same warehouse, ranges and
domain as Dagster does, and say where each setting came from. A `defs.yaml` that uses dg's templating
(`{{ env.X }}`) is read through dg's own loader (`ComponentTree`), so it resolves as in the code location; a plain
one is read directly, without importing Dagster (`es-pipeline sql` stays quick). Outside a dg project, or in one
without the component, the environment alone, as before.

`materialize()` runs es_pipeline's assets in this process on the project's Dagster instance: `events`, range by
range, then every projection, recorded in Dagster as any run. The only modules here that reach Dagster, when
called (pyproject.toml names the door).
"""

from __future__ import annotations

import os
import re
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from es_pipeline.errors import ConfigError
from es_pipeline.settings import (
    ATTRIBUTES,
    COMPONENT_ATTRIBUTES,
    Settings,
    attribute_variables,
    from_component,
)

COMPONENT_TYPES = ("es_pipeline.component.EsPipeline", "es_pipeline.EsPipeline")


@dataclass(frozen=True)
class Configuration:
    settings: Settings
    project: Path | None = None  # the dg project's root, if the command runs inside one
    component: str | None = None  # its EsPipeline component's defs.yaml, relative to the project
    note: str = ""  # why the component was not read, where that matters

    def source_of(self, variable: str) -> str:
        """Where `variable`'s value came from: the component's attribute, the environment, or the default."""
        origin = self.settings.origin(variable)
        if origin != variable:
            return origin
        return "environment" if os.environ.get(variable, "").strip() else "default"


def dg_project_root(start: Path) -> Path | None:
    """The nearest folder at or above `start` with a `dg.toml`, or a `pyproject.toml` with a [tool.dg] table."""
    here = start.resolve()
    for folder in (here, *here.parents):
        if (folder / "dg.toml").is_file():
            return folder
        manifest = folder / "pyproject.toml"
        if manifest.is_file():
            try:
                if "dg" in tomllib.loads(manifest.read_text()).get("tool", {}):
                    return folder
            except tomllib.TOMLDecodeError:
                return None
    return None


def _documents(path: Path) -> Iterator[dict]:
    try:
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict):
                yield doc
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), "(YAML)", f"a valid YAML file ({str(exc).splitlines()[0]})") from None


def _defs_folders(root: Path) -> list[Path]:
    """Where the project's `defs.yaml` files are: its defs module's folder (`[tool.dg.project]` `defs_module`, by
    default `<root_module>.defs`), under `src/` or not; the whole project where it says none."""
    manifest = root / "dg.toml" if (root / "dg.toml").is_file() else root / "pyproject.toml"
    try:
        conf = tomllib.loads(manifest.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return [root]
    project = conf.get("project", {}) if manifest.name == "dg.toml" else conf.get("tool", {}).get("dg", {}).get("project", {})
    module = project.get("defs_module") or (f"{project['root_module']}.defs" if project.get("root_module") else None)
    if module is None:
        return [root]
    relative = Path(*module.split("."))
    return [d for d in (root / "src" / relative, root / relative) if d.is_dir()] or [root]


def components(root: Path) -> list[Path]:
    """The `defs.yaml` files of the project's defs folder that declare an EsPipeline component."""
    skip = {".venv", "node_modules", ".git", ".cache", "warehouse", ".dagster_home", ".pgdata"}
    found = []
    for folder in _defs_folders(root):
        for path in sorted(folder.rglob("defs.yaml")):
            if skip & set(path.relative_to(root).parts):
                continue
            if any(doc.get("type") in COMPONENT_TYPES for doc in _documents(path)):
                found.append(path)
    return found


def configuration(component: str | None = None, cwd: Path | None = None) -> Configuration:
    """The settings the command line runs with: the environment's, with the dg project's EsPipeline attributes in
    their variables' place. `component`: the folder of the one to read, where a project has several."""
    root = dg_project_root(cwd or Path.cwd())
    if root is None:
        if component:
            raise ConfigError("--component", component, "a component of a dg project: run inside the project's folder")
        return Configuration(Settings.from_env())
    found = components(root)
    names = {path.parent.name: path for path in found}
    if component:
        if component not in names:
            raise ConfigError("--component", component, f"one of {', '.join(names) or '(none: no EsPipeline component here)'}")
        found = [names[component]]
    if not found:
        return Configuration(Settings.from_env(), root, None,
                             f"no EsPipeline component in {root} (`dg scaffold defs es_pipeline.component.EsPipeline lake`)")
    if len(found) > 1:
        raise ConfigError("--component", "", f"one of {', '.join(names)}: the project has several EsPipeline components")
    path = found[0]
    where = str(path.relative_to(root))
    return Configuration(from_component(_attributes(path, root, where), where, root), root, where)


def _attributes(path: Path, root: Path, where: str = "") -> dict:
    doc = next(d for d in _documents(path) if d.get("type") in COMPONENT_TYPES)
    written = dict(doc.get("attributes") or {})
    # A misspelled attribute is named in one line before dg's loader reports it in seventy.
    attribute_variables({k: v for k, v in written.items() if k not in COMPONENT_ATTRIBUTES}, root)
    if "{{" not in path.read_text():
        return written
    # Templated: dg's loader resolves it exactly as the code location does.
    import dagster as dg

    from es_pipeline.component import EsPipeline

    try:
        tree = dg.ComponentTree.for_project(root)
        loaded = tree.load_component(path.parent.resolve().relative_to(tree.defs_module_path.resolve()), EsPipeline)
    except Exception as exc:  # noqa: BLE001 - dg's error wraps the cause in pages of context: its last line says it
        raise _refusal(exc, where or str(path)) from exc
    return {k: v for k, v in loaded.model_dump().items() if v is not None and v != []}


def _refusal(exc: BaseException, where: str) -> ConfigError:
    """dg's error as one line: an attribute the component's schema refused (a mode outside its `Literal`, text for a
    number) names the attribute, its value and what its declaration accepts; anything else, the cause's last line."""
    from pydantic import ValidationError

    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ValidationError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, ValidationError) and cause.errors():
        error = cause.errors()[0]
        name = next((str(part) for part in reversed(error["loc"]) if str(part) in ATTRIBUTES), None)
        if name is not None:
            kind = ATTRIBUTES[name].kind
            accepts = getattr(kind, "accepts", "") or error["msg"]
            return ConfigError(f"attribute `{name}` of {where}", str(error.get("input", "")), accepts)
    return ConfigError(f"the EsPipeline component in {where}", "", _last_line(exc))


def _last_line(exc: BaseException) -> str:
    """The innermost cause's message, its last non-empty line (dg's errors end with what is wrong)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def dagster_home(settings: Settings) -> Path:
    """The Dagster instance's folder: DAGSTER_HOME, else the project's `.dagster_home` (made here)."""
    home = Path(os.environ.get("DAGSTER_HOME") or settings.dagster_home)
    home.mkdir(parents=True, exist_ok=True)
    return home


@dataclass(frozen=True)
class Materialized:
    asset: str
    partition: str | None
    seconds: float
    metadata: dict


def materialize(settings: Settings, *, progress: Callable[[Materialized], None] = lambda _: None) -> list[Materialized]:
    """Brings the lake up to date in this process, through Dagster: `events` for every slice range, then every
    projection (stream_state, the aggregates, the team's typed tables and cross-stream projections), then the stream
    types waiting for their rebuild beside `stream_state` (a new type, a revision, an upcaster), unless
    ES_PIPELINE_REBUILDS=hold (`rebuilds_waiting` says which wait then). The snapshots stay with their schedule. Each
    is a run on the project's instance, as if launched from the UI."""
    import dagster as dg

    from es_pipeline.lake.state import rebuild
    from es_pipeline.location import REBUILDS_JOB, build_definitions

    domain = settings.load_domain()
    defs = build_definitions(settings, domain)
    instance = dg.DagsterInstance.from_config(str(dagster_home(settings)))
    resources = dict(defs.resources or {})
    assets = [a for a in defs.assets or [] if isinstance(a, dg.AssetsDefinition)]
    events = next(a for a in assets if a.key == dg.AssetKey("events"))
    projections = [a for a in assets if a.key not in (dg.AssetKey("events"), dg.AssetKey("snapshots"))]
    done = []
    for key in partition_keys(settings):
        t0 = time.monotonic()
        result = dg.materialize([events], partition_key=key, resources=resources, instance=instance,
                                tags=_LAUNCHED, run_config=_QUIET, raise_on_error=False)
        _succeeded(result)
        done.append(_report(result, "events", key, t0))
        progress(done[-1])
    t0 = time.monotonic()
    result = dg.materialize(projections, resources=resources, instance=instance, tags=_LAUNCHED, run_config=_QUIET,
                            raise_on_error=False)
    for materialization in result.get_asset_materialization_events():
        data = materialization.step_materialization_data.materialization
        done.append(Materialized(data.asset_key.to_user_string(), None, time.monotonic() - t0,
                                 {k: v.value for k, v in data.metadata.items()}))
        progress(done[-1])
    _succeeded(result)
    waiting = rebuild.waiting(settings.warehouse, domain)
    if waiting and settings.rebuilds != "hold":
        t0 = time.monotonic()
        _succeeded(defs.resolve_job_def(REBUILDS_JOB).execute_in_process(
            instance=instance, tags=_LAUNCHED, run_config=_QUIET, raise_on_error=False))
        done.append(Materialized("stream_state rebuilds", None, time.monotonic() - t0, {"types": ", ".join(waiting)}))
        progress(done[-1])
    return done


def rebuilds_waiting(settings: Settings) -> list[str]:
    """The stream types whose rows in `stream_state` wait for their rebuild beside it (lake/state/rebuild.py): not up
    to date, whatever the tables' positions say."""
    from es_pipeline.lake.state import rebuild

    return rebuild.waiting(settings.warehouse, settings.load_domain())


_LAUNCHED = {"es_pipeline/launched_by": "es-pipeline materialize"}
# The runs' own log stays in the instance (the UI shows it); the console gets the progress lines and, where a run
# fails, one line (`RunFailed`), not Dagster's debug lines and the stack trace three times.
_QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


def _succeeded(result: Any) -> None:
    """`RunFailed` with the first failed step's asset and cause, where the run failed."""
    if result.success:
        return
    from es_pipeline.errors import RunFailed

    failures = result.get_step_failure_events()
    if not failures:
        raise RunFailed(result.run_id, "the run did not succeed (its log in the Dagster instance says why)")
    failed = failures[0]
    error = failed.step_failure_data.error
    cause = error.message.strip().splitlines()[0] if error is not None else "no error recorded"
    cause = re.sub(r"^[\w.]+(Error|Failure|Exception): ", "", cause)  # "dagster…Failure: reducer failed …"
    raise RunFailed(failed.step_key or "a step", cause)


def _report(result, asset: str, partition: str | None, t0: float) -> Materialized:
    metadata: dict = {}
    for materialization in result.get_asset_materialization_events():
        metadata.update({k: v.value for k, v in materialization.step_materialization_data.materialization.metadata.items()})
    return Materialized(asset, partition, time.monotonic() - t0, metadata)


def partition_keys(settings: Settings) -> list[str]:
    """The `events` asset's partition keys: one per slice range (`0000-0255` ... for 4 ranges)."""
    from es_pipeline.extraction.slices import split

    return [r.key for r in split(settings.slice_ranges)]
