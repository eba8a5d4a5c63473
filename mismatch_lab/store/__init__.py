"""The store: schema (the data contract, docs/design.md), DuckDB writer, Parquet shard store, read-only reader, export."""

from mismatch_lab.store.schema import SCHEMA_VERSION, create_schema

__all__ = ["SCHEMA_VERSION", "create_schema"]
