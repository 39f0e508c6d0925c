"""The lake's checks (es_pipeline/checks/) as Dagster asset checks: one per declaration, of the same name, table,
description and blocking; the outcome's figures as the evaluation's metadata.

Beside the materialization of one partition of `events`, a scoped check (the checks of `events`) checks that
partition's slices only; on `lake_checks_job`'s schedule, with no partition, every slice. Not Dagster's partitioned
asset checks: a partitioned check runs only with a partition key, so the table-wide hourly job would become one run
per range (docs/decisions/0050-checks-in-the-library.md).
"""

import dagster as dg
from dagster._core.errors import DagsterInvalidPropertyError

from es_pipeline import checks
from es_pipeline.checks import Check, Given
from es_pipeline.defs.resources import (
    CatalogResource,
    EventStoreResource,
    SparkResource,
    WarehouseResource,
    engine_of,
)
from es_pipeline.domain import Domain
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake.kernel.engine import Engine

PARTITION_TAG = "dagster/partition"


def scope_of(context: dg.AssetCheckExecutionContext | None) -> SliceRange | None:
    """The slice range of the partition this check runs beside, or None (the whole table)."""
    try:
        key = context.run.tags.get(PARTITION_TAG) if context is not None else None
    except DagsterInvalidPropertyError:  # invoked directly, outside a run: the whole table
        key = None
    return SliceRange.from_key(key) if key else None


def asset_check(check: Check) -> dg.AssetChecksDefinition:
    """`check` as a Dagster asset check, run with the location's resources (the catalog's only where it reads it)."""
    if check.table == "catalog":

        @dg.asset_check(asset=check.table, name=check.name, description=check.description, blocking=check.blocking)
        def _catalog_check(warehouse: WarehouseResource, event_store: EventStoreResource,
                           metastore: CatalogResource) -> dg.AssetCheckResult:
            given = Given(Engine("local"), warehouse.root, event_store.dsn, event_store.events_source(),
                          metastore=metastore.metastore())
            return _result(check, given)

        return _catalog_check

    @dg.asset_check(asset=check.table, name=check.name, description=check.description, blocking=check.blocking)
    def _check(context: dg.AssetCheckExecutionContext, spark: SparkResource, warehouse: WarehouseResource,
               event_store: EventStoreResource) -> dg.AssetCheckResult:
        given = Given(engine_of(warehouse, spark), warehouse.root, event_store.dsn, event_store.events_source(),
                      scope_of(context) if check.scoped else None)
        return _result(check, given)

    return _check


def _result(check: Check, given: Given) -> dg.AssetCheckResult:
    outcome = check.run(given)
    return dg.AssetCheckResult(passed=outcome.passed, metadata=outcome.metadata)


BUILTIN = {check.name: asset_check(check) for check in checks.BUILTIN}  # by name: snapshots_job selects one
EVENTS_CHECKS = [BUILTIN[check.name] for check in checks.events.CHECKS]


def build_asset_checks(domain: Domain) -> list[dg.AssetChecksDefinition]:
    """Every check of the location: the built-in tables', and one per cross-stream projection of `domain`."""
    return [*BUILTIN.values(), *(asset_check(c) for c in checks.projections.domain_checks(domain))]
