"""The Dagster layer: resources, and one folder per domain. Only the code location imports it (`es_pipeline.location`,
which `es_pipeline.definitions` and the component load): no library module, no CLI command, no dev tool.

Each module here reads its inputs, calls one library function (store, extraction, lake) and returns
what Dagster plots or decides on; the logic lives in the library, where it is tested without Dagster.
"""
