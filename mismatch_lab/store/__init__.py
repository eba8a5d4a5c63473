"""DuckDB store: schema (the data contract of DESIGN.md), writer, read-only reader, Parquet export."""

from mismatch_lab.store.schema import SCHEMA_VERSION, create_schema

__all__ = ["SCHEMA_VERSION", "create_schema"]
