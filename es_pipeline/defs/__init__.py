"""The Dagster layer: resources, and one folder per domain. Only `es_pipeline.definitions` imports it.

Each module here reads its inputs, calls one library function (store, extraction, lake) and returns
what Dagster plots or decides on; the logic lives in the library, where it is tested without Dagster.
"""
